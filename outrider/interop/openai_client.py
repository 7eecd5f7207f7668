"""A minimal client for OpenAI-compatible chat endpoints (vLLM, SGLang, llama.cpp, ...).

Contract:
- ``ChatClient(server, model)`` talks to ``{server}/v1/chat/completions`` (``server`` may or may
  not end in ``/v1``) with the standard library only (``urllib``); it is safe to share between
  threads (each call opens its own connection).
- ``check()`` confirms the server answers at all and returns the model name to use (the given
  one, or the first one ``/v1/models`` lists). A server that cannot be reached is a ``UserError``.
- ``post(path, body, kept)`` sends one JSON request with the retries below; ``chat(messages,
  max_tokens, temperature=0.0, seed=None)`` returns the assistant text of a greedy
  reply, or of one sampled at ``temperature`` (> 0) with ``top_p`` 1 (not the server's default) and
  the request's ``seed`` when given.
  Connection failures, timeouts, HTTP 408/429 and 5xx are retried with exponential backoff; when
  the attempts are used up it raises ``UserError`` (the run is resumable, so the message says so).
  Any other HTTP 4xx means the server refuses this particular request (a prompt longer than its
  context, say) and raises ``ServerRejected``, which the caller handles per conversation.

Not done here: streaming, sampling parameters other than the temperature, authentication beyond an
optional bearer token passed in explicitly, tool calls.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from outrider.errors import UserError
from outrider.interop.openai_api import base_url, chat_body, served_model, short

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class ServerRejected(Exception):
    """The server answered this request with a non-retryable 4xx status."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


class ChatClient:
    """Greedy chat completions from one OpenAI-compatible server."""

    def __init__(self, server: str, model: str | None = None, timeout: float = 300.0, retries: int = 5,
                 backoff: float = 1.0, api_key: str | None = None):
        self.base = base_url(server)
        self.model = model
        self.timeout = float(timeout)
        self.retries = max(1, int(retries))
        self.backoff = float(backoff)
        self.api_key = api_key

    def _request(self, url: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            payload = resp.read()
        try:
            return json.loads(payload)
        except json.JSONDecodeError:
            text = short(payload.decode("utf-8", "replace"))
            raise ServerRejected(200, f"the reply from {url} is not JSON: {text}") from None

    def check(self) -> str:
        """Probe the server; return the model name to request. ``UserError`` if it is unreachable."""
        try:
            listing = self._request(self.base + "/v1/models", None)
        except urllib.error.HTTPError as e:  # it answers, just not /v1/models
            listing = {}
            e.close()
        except ServerRejected:
            listing = {}
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise UserError(f"cannot reach the server at {self.base}: {reason} (start it, or fix --server)") from None
        self.model = served_model(self.base, listing, self.model)
        return self.model

    def chat(self, messages: list[dict[str, str]], max_tokens: int, temperature: float = 0.0,
             seed: int | None = None) -> str:
        """The assistant reply to ``messages`` (greedy at temperature 0). Raises ``ServerRejected`` or
        ``UserError``."""
        body = chat_body(self.model, messages, max_tokens, temperature, seed, stream=False)
        reply = self.post("/v1/chat/completions", body, "finished conversations are kept and skipped")
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            detail = short(json.dumps(reply))
            raise ServerRejected(200, f"no choices[0].message.content in the reply: {detail}") from None
        return "" if content is None else str(content)

    def post(self, path: str, body: dict[str, Any], kept: str) -> dict[str, Any]:
        """POST ``body`` to ``{server}{path}``, retried as the module docstring says; ``kept`` ends the
        one line given when the attempts are used up (what a rerun keeps)."""
        last = ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                return self._request(self.base + path, body)
            except urllib.error.HTTPError as e:
                detail = short(e.read().decode("utf-8", "replace")) if e.fp is not None else str(e.reason)
                e.close()
                if e.code not in _RETRY_STATUS:
                    raise ServerRejected(e.code, detail) from None
                last = f"HTTP {e.code}: {detail}"
            except (urllib.error.URLError, OSError) as e:
                last = str(getattr(e, "reason", e))
        raise UserError(f"the server at {self.base} failed {self.retries} times (last: {last}); "
                        f"check it is running and rerun: {kept}")
