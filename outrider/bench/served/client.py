"""A streaming client for one OpenAI-compatible server: probe it, stream chat replies, time them.

Contract:
- ``Endpoint(server, model, timeout)``: ``server`` is an http(s) URL (a trailing ``/v1`` is
  dropped). ``timeout`` (seconds) bounds every wait on the server: connecting, the first byte,
  and each gap between streamed lines; a stalled stream therefore ends within ``timeout``.
- ``probe()`` lists ``/v1/models`` and returns the model to request (the given one, which must
  be listed, else the first); an unreachable server, a model it does not serve, or no model at
  all is a ``UserError`` (one line). ``scrape()`` returns ``/metrics`` text, or None when the
  server has none (or, with ``reachable=False``, cannot be reached); ``engine_info()`` what
  ``/version`` and ``/get_server_info`` say (empty when absent). These are single GETs, never retried.
- ``stream(messages, max_tokens, temperature, seed)`` sends one chat completion with
  ``stream: true`` and ``stream_options.include_usage`` and returns a ``Reply``: text, the
  send/first-token/chunk times (``time.perf_counter``), completion tokens (the server's usage
  when it reports it, else the count of content chunks: ``tokens_from``), finish reason, and
  ``error`` (one line) instead of raising when the server fails, refuses, stalls or breaks
  the stream. It never retries: a benchmark counts failures. The stream is bounded: at most
  ``8 * max_tokens + 64`` lines are read.

Not done here: concurrency and statistics (``served.measure``), authentication beyond a bearer
token given explicitly, tools, non-chat completions.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from outrider.errors import UserError
from outrider.interop.openai_api import base_url, chat_body, served_model, short


@dataclass
class Reply:
    text: str = ""
    sent: float = 0.0
    first: float | None = None  # first content chunk
    chunks: list[float] = field(default_factory=list)  # arrival time of every content chunk
    tokens: int = 0
    tokens_from: str = "chunks"  # "usage" when the server reported completion_tokens
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    done: float = 0.0
    error: str | None = None


def _why(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or e
    if isinstance(reason, (socket.timeout, TimeoutError)) or "timed out" in str(reason):
        return "timed out"
    return short(reason)


class Endpoint:
    def __init__(self, server: str, model: str | None = None, timeout: float = 60.0, api_key: str | None = None):
        self.base = base_url(server)
        self.model = model
        self.timeout = float(timeout)
        self.api_key = api_key

    def _open(self, path: str, body: dict[str, Any] | None = None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.base + path, data=data, headers=headers,
                                     method="GET" if body is None else "POST")
        return urllib.request.urlopen(req, timeout=self.timeout)

    def _get(self, path: str, reachable: bool = True) -> bytes | None:
        """The body of a GET, None on an HTTP error status; an unreachable server raises ``UserError``
        (``reachable=False``: gives None, for a scrape after requests that may have failed)."""
        try:
            with self._open(path) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            e.close()
            return None
        except (urllib.error.URLError, OSError) as e:
            if not reachable:
                return None
            raise UserError(f"cannot reach the server at {self.base}: {_why(e)} (start it, or fix --server)") from None

    def probe(self) -> str:
        raw = self._get("/v1/models")
        try:
            listing = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            listing = {}
        self.model = served_model(self.base, listing, self.model)
        return self.model

    def scrape(self, reachable: bool = True) -> str | None:
        raw = self._get("/metrics", reachable)
        return None if raw is None else raw.decode("utf-8", "replace")

    def engine_info(self) -> dict[str, Any]:
        """``/version`` (vLLM, SGLang) and ``/get_server_info`` (SGLang) as JSON objects, when served."""
        out: dict[str, Any] = {}
        for path in ("/version", "/get_server_info"):
            raw = self._get(path)
            try:
                data = json.loads(raw) if raw else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                data = None
            if isinstance(data, dict):
                out[path] = data
        return out

    def stream(self, messages: list[dict[str, str]], max_tokens: int, temperature: float = 0.0,
               seed: int | None = None) -> Reply:
        body = chat_body(self.model, messages, max_tokens, temperature, seed, stream=True)
        r = Reply(sent=time.perf_counter())
        try:
            with self._open("/v1/chat/completions", body) as resp:
                self._read(resp, r, 8 * int(max_tokens) + 64)
        except urllib.error.HTTPError as e:
            detail = short(e.read().decode("utf-8", "replace")) if e.fp is not None else short(e.reason)
            e.close()
            r.error = f"HTTP {e.code}: {detail}"
        except (urllib.error.URLError, OSError) as e:
            r.error = ("stalled: no data for " + f"{self.timeout:g} s (--timeout)") if _why(e) == "timed out" \
                else f"connection failed: {_why(e)}"
        r.done = time.perf_counter()
        if r.error is None and r.finish_reason is None:
            r.error = "the stream ended without a finish reason"
        return r

    @staticmethod
    def _read(resp, r: Reply, max_lines: int) -> None:
        for _ in range(max_lines):
            line = resp.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            try:
                chunk = json.loads(payload)
            except (json.JSONDecodeError, UnicodeDecodeError):
                r.error = f"not JSON in the stream: {short(payload.decode('utf-8', 'replace'))}"
                return
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                r.error = f"the server sent an error: {short(chunk['error'])}"
                return
            usage = chunk.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                r.tokens, r.tokens_from = usage["completion_tokens"], "usage"
                if isinstance(usage.get("prompt_tokens"), int):
                    r.prompt_tokens = usage["prompt_tokens"]
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    r.first = now if r.first is None else r.first
                    r.chunks.append(now)
                    r.text += content
                    if r.tokens_from == "chunks":
                        r.tokens += 1
                if choice.get("finish_reason"):
                    r.finish_reason = choice["finish_reason"]
        r.error = f"the stream went on past {max_lines} lines for max_tokens; stopped reading"
