"""Reading conversations: ShareGPT and OpenAI records from files, or the embedded ShareGPT.

Contract: ShareGPT records (``conversations: [{from: human|gpt|system, value}]``) and OpenAI
records (``messages: [{role, content}]``), from a JSON list or a JSONL file, become
``[{role, content}]`` with roles ``system``/``user``/``assistant``. Assistant turns before any user
turn are removed (a reply to nothing). A record that cannot be used raises ``Dropped`` with a
reason (counted by the caller); a file with nothing usable is a ``UserError``. The embedded
ShareGPT's held-out conversations (``sharegpt.held_out_filter``) are never read for training."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from outrider import assets, sharegpt
from outrider.errors import UserError
from outrider.fsutil import read_text

_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system", "developer": "system",
}


# --------------------------------------------------------------------------------------------
# Reading and normalising conversations


@dataclass
class Conversation:
    conv_id: str
    messages: list[dict[str, str]]  # [{role: system|user|assistant, content}]


class Dropped(Exception):
    """A conversation that cannot be used; ``reason`` is a short snake_case key for the counts."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _turn_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise Dropped("non_text_content")
        return "".join(texts)
    raise Dropped("malformed_turn")


def normalise_record(record: Any) -> list[dict[str, str]]:
    """One ShareGPT or OpenAI record -> ``[{role, content}]``. Raises ``Dropped``."""
    if not isinstance(record, dict):
        raise Dropped("unrecognised_record")
    turns = record.get("conversations")
    if not isinstance(turns, list):
        turns = record.get("messages")
    if not isinstance(turns, list):
        raise Dropped("unrecognised_record")
    messages: list[dict[str, str]] = []
    seen_user = False
    for turn in turns:
        if not isinstance(turn, dict):
            raise Dropped("malformed_turn")
        raw_role = turn.get("from", turn.get("role"))
        role = _ROLES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise Dropped("unknown_role")
        content = _turn_text(turn["value"] if "value" in turn else turn.get("content"))
        if role == "assistant" and not seen_user:
            continue
        seen_user = seen_user or role == "user"
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise Dropped("no_assistant_turn")
    return messages


def read_records(path: str | Path) -> list[Any]:
    """Records of a JSON list or a JSONL file. ``UserError`` for a missing, empty or non-JSON file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"dataset not found: {p} (give a .json or .jsonl file, or 'sharegpt')")
    if p.is_dir():
        raise UserError(f"{p} is a directory: give a .json or .jsonl file of conversations")
    text = read_text(p, "a .json or .jsonl file of conversations")
    if not text.strip():
        raise UserError(f"{p} is empty: it must hold ShareGPT or OpenAI conversations (JSON list or JSONL)")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as whole:
        if text.lstrip().startswith("["):
            raise UserError(f"{p} is not valid JSON: {whole.msg} at line {whole.lineno} column {whole.colno}") from None
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{p} is neither JSON nor JSONL: line {n}: {e.msg} at column {e.colno}") from None
    else:
        if isinstance(obj, list):
            records = obj
        elif isinstance(obj, dict):  # one record (a one-line JSONL file)
            records = [obj]
        else:
            raise UserError(f"{p}: expected a JSON list of conversations or JSONL, got a JSON {type(obj).__name__}")
    if not records:
        raise UserError(f"{p} holds no conversations: it must hold ShareGPT or OpenAI records")
    return records


@dataclass
class _Source:
    name: str
    conversations: list[Conversation]
    dropped: Counter
    scanned: int = 0
    heldout_excluded: int = 0
    note: str = ""


def load_source(dataset: str, max_conversations: int | None) -> _Source:
    """Read, normalise and limit the conversations; held-out ShareGPT ones are excluded (by id, or
    opening with a held-out prompt: ``sharegpt.held_out_filter``)."""
    exclude: Callable[[dict], bool] | None = None  # held out for benchmarks (the embedded ShareGPT)
    note = ""
    if dataset == "sharegpt":
        sg = sharegpt.load_sharegpt(assets.sharegpt_path(pulled=True))
        records = list(sg.conversations)
        exclude = sharegpt.held_out_filter(records)
        note = str(getattr(sg, "note", "") or "")
        name = "sharegpt"
        if not records:
            raise UserError("the embedded ShareGPT holds no conversations: run `outrider pull` again")
    else:
        records = read_records(dataset)
        name = str(Path(dataset).expanduser())
    src = _Source(name=name, conversations=[], dropped=Counter(), note=note)
    ids: Counter = Counter()
    for index, record in enumerate(records):
        if max_conversations is not None and len(src.conversations) >= max_conversations:
            break
        raw_id = record.get("id", record.get("conversation_id")) if isinstance(record, dict) else None
        raw_id = str(index) if raw_id is None else str(raw_id)
        if exclude is not None and isinstance(record, dict) and exclude(record):
            src.heldout_excluded += 1
            continue
        src.scanned += 1
        try:
            messages = normalise_record(record)
        except Dropped as d:
            src.dropped[d.reason] += 1
            continue
        ids[raw_id] += 1
        conv_id = raw_id if ids[raw_id] == 1 else f"{raw_id}#{ids[raw_id]}"
        src.conversations.append(Conversation(conv_id, messages))
    if not src.conversations:
        if src.dropped and set(src.dropped) == {"unrecognised_record"}:
            raise UserError(f"no ShareGPT (conversations: [{{from, value}}]) or OpenAI (messages: [{{role, content}}]) "
                            f"records in {name}")
        if src.dropped.get("no_assistant_turn", 0) == sum(src.dropped.values()) and src.dropped:
            raise UserError(f"no conversation in {name} has an assistant turn: nothing to learn from")
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(src.dropped.items())) or "none read"
        raise UserError(f"no usable conversation in {name} ({detail})")
    return src
