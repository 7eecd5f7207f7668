"""What every OpenAI-compatible server answers the same way, for both of outrider's clients (the
chat client ``openai_client``, which regeneration uses, and the served benchmark's streaming
client): the base URL as given (``/v1`` optional), the model to request from the ``/v1/models``
listing, a server's text cut to one line for a message, and the body of a chat request
(``chat_body``: top_p 1 when sampling, the seed when given).

Not done here: sending requests (each client sends its own: blocking JSON replies, or streamed chunks).
"""

from __future__ import annotations

from typing import Any

from outrider.errors import UserError


def chat_body(model: str | None, messages: list[dict[str, str]], max_tokens: int, temperature: float,
              seed: int | None, stream: bool) -> dict[str, Any]:
    """A ``/v1/chat/completions`` request body."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": int(max_tokens),
                            "temperature": float(temperature), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if temperature:
        body["top_p"] = 1.0
    if seed is not None:
        body["seed"] = int(seed)
    return body


def base_url(server: str) -> str:
    """``http(s)://host:port`` of ``--server``, without a trailing ``/v1``."""
    url = server.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"--server must be an http(s) URL such as http://127.0.0.1:8000, got '{server}'")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def short(text: Any, limit: int = 200) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def served_model(base: str, listing: Any, model: str | None) -> str:
    """The model to request: ``model`` (``--server-model``) when the server lists it or lists
    nothing, else the first one ``listing`` (the JSON of ``/v1/models``) names."""
    entries = listing.get("data") if isinstance(listing, dict) else None
    models = [str(m["id"]) for m in entries or [] if isinstance(m, dict) and m.get("id")]
    if model:
        if models and model not in models:
            raise UserError(f"the server at {base} serves {', '.join(models)}, not '{model}': fix --server-model")
        return model
    if not models:
        raise UserError(f"the server at {base} lists no model under /v1/models: pass --server-model NAME")
    return models[0]
