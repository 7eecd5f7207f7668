"""The embedded ShareGPT: reading the cut file, the held-out split, and prompt identity.

Contract: ``load_sharegpt(path)`` reads the JSON list element by element, so a file cut off
mid-record (as the shipped one is: 17,671 complete conversations) yields its complete records and
a note on what the cut dropped; malformed JSON before the end is a ``UserError``. ``heldout`` is
the one train/benchmark split: a stable hash of the conversation id with its ``_N`` part suffix
removed. ShareGPT repeats opening prompts under other ids: ``held_out_filter`` also holds out every
conversation that opens with a held-out conversation's prompt (case and whitespace folded, or the
same first 64 characters of a long prompt: ``prompt_marks``), so no benchmark prompt's reply is
ever learnt. ``first_user_turns`` gives the benchmark prompts."""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from outrider.errors import UserError

HELDOUT_FRACTION = 0.02
_HELDOUT_SALT = b"outrider-heldout-v1"
_HELDOUT_BUCKETS = 10_000


# ----------------------------------------------------------------------------- ShareGPT


@dataclass
class ShareGPT:
    path: Path
    conversations: list[dict[str, Any]]  # each {"id": str, "conversations": [{"from", "value"}, ...]}
    complete: int  # number of complete records read
    truncated: bool  # the file ends before the list is closed
    dropped_bytes: int  # bytes after the last complete record that could not be read
    dropped_records: int  # records cut off part-way (0 or 1: what lies beyond the cut is unknown)
    note: str  # one-line human summary

    def __len__(self) -> int:
        return len(self.conversations)


_WS = " \t\n\r"


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _is_cut(err: json.JSONDecodeError, text: str) -> bool:
    """Whether a decode error is explained by the text simply ending (not by malformed JSON)."""
    return err.msg.startswith("Unterminated string") or len(text) - err.pos <= 6


def load_sharegpt(path: Path | str) -> ShareGPT:
    """Read a ShareGPT JSON list, keeping every complete record of a file that was cut off.

    Records must be objects with a ``conversations`` list; one without an ``id`` gets its index
    as id. Malformed JSON before the end of the file, or a top level that is not a list, is a
    ``UserError``.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    text = codecs.getincrementaldecoder("utf-8")(errors="strict").decode(raw, final=False)
    text = text.lstrip("\ufeff")
    tail_bytes = len(raw) - len(text.encode("utf-8"))  # an incomplete UTF-8 sequence at the very end

    i = _skip_ws(text, 0)
    if i >= len(text):
        raise UserError(f"{path} is empty: expected a JSON list of ShareGPT records")
    if text[i] != "[":
        raise UserError(f"{path} is not a JSON list (starts with {text[i]!r}): expected ShareGPT records")
    i += 1
    decoder = json.JSONDecoder()
    records: list[dict[str, Any]] = []
    truncated = True
    cut_at = len(text)
    partial = 0
    expect_value = False
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            cut_at = i
            break
        if text[i] == "]" and not expect_value:
            truncated = False
            break
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if not _is_cut(e, text):
                offset = len(text[:e.pos].encode("utf-8"))
                raise UserError(f"{path} is malformed at byte {offset} (record {len(records) + 1}): {e.msg}") from None
            cut_at, partial = i, 1
            break
        if not isinstance(obj, dict) or not isinstance(obj.get("conversations"), list):
            raise UserError(f"{path}: record {len(records) + 1} is not an object with a 'conversations' list")
        obj.setdefault("id", str(len(records)))
        records.append(obj)
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i += 1
            expect_value = True
        elif i < len(text) and text[i] != "]":
            offset = len(text[:i].encode("utf-8"))
            raise UserError(f"{path} is malformed at byte {offset}: expected ',' or ']' after record {len(records)}")
        else:
            expect_value = False
    if truncated:
        dropped = len(text[cut_at:].encode("utf-8")) + tail_bytes
        if partial:
            note = (f"{path.name} is cut off inside record {len(records) + 1:,}: kept {len(records):,} complete "
                    f"conversations, dropped the last {dropped:,} bytes (1 partial record)")
        else:
            note = (f"{path.name} ends without closing its list: kept {len(records):,} complete "
                    f"conversations, no partial record ({dropped:,} trailing bytes)")
    else:
        dropped = 0
        note = f"{path.name} is complete: {len(records):,} conversations"
    return ShareGPT(path=path, conversations=records, complete=len(records), truncated=truncated,
                    dropped_bytes=dropped, dropped_records=partial, note=note)


def heldout(conv_id: str) -> bool:
    """Whether a conversation belongs to the held-out (benchmark) split, about 2% of them.

    Stable across runs, machines and Python versions (blake2b, not ``hash``). The ``_N`` part
    suffix of ShareGPT ids is dropped first, so all parts of one conversation share a side.
    """
    base = re.sub(r"_\d+$", "", str(conv_id))
    digest = hashlib.blake2b(base.encode("utf-8"), digest_size=8, key=_HELDOUT_SALT).digest()
    return int.from_bytes(digest, "big") % _HELDOUT_BUCKETS < round(HELDOUT_FRACTION * _HELDOUT_BUCKETS)


def opening_prompt(conv: dict[str, Any]) -> str | None:
    """The text of a conversation's opening user turn (after any system turns), or None: a part of
    a split conversation that opens with the assistant, an empty turn, a record without turns."""
    turns = [t for t in conv.get("conversations") or [] if isinstance(t, dict) and t.get("from") != "system"]
    if not turns or turns[0].get("from") not in ("human", "user"):
        return None
    value = turns[0].get("value")
    return value if isinstance(value, str) and value.strip() else None


def prompt_key(text: str) -> str:
    """What two copies of one prompt share: case and runs of whitespace folded."""
    return " ".join(text.split()).casefold()


PREFIX_CHARS = 64  # two prompts whose keys are this long and agree this far are one task, cut or extended


def prompt_prefix(key: str) -> str | None:
    """The first ``PREFIX_CHARS`` characters of a ``prompt_key`` at least that long, else None
    (a short prompt is judged whole)."""
    return key[:PREFIX_CHARS] if len(key) >= PREFIX_CHARS else None


def prompt_marks(text: str) -> set[str]:
    """The marks of one prompt; two prompts are copies when their marks meet: the same
    ``prompt_key``, or the same ``prompt_prefix`` (ShareGPT also holds one task's prompt cut short
    or extended, e.g. a held-out prompt that stops where a training-split conversation's prompt
    goes on for another line)."""
    key = prompt_key(text)
    prefix = prompt_prefix(key)
    return {key} if prefix is None else {key, "\0" + prefix}


def _openings(conversations: Iterable[dict[str, Any]] | ShareGPT, held_out: bool) -> set[str]:
    """The ``prompt_marks`` of every opening prompt of the held-out (or the training-split) conversations."""
    if isinstance(conversations, ShareGPT):
        conversations = conversations.conversations
    return {m for conv in conversations if isinstance(conv, dict)  # a malformed record opens nothing
            and heldout(str(conv.get("id", ""))) == held_out and (p := opening_prompt(conv)) is not None
            for m in prompt_marks(p)}


def held_out_filter(conversations: Iterable[dict[str, Any]] | ShareGPT) -> Callable[[dict[str, Any]], bool]:
    """A predicate for building training data from ``conversations``: True for a held-out
    conversation (``heldout`` of its id) and for one that opens with the same prompt as a held-out
    conversation (``prompt_marks``): ShareGPT repeats prompts under other ids (145 of the embedded
    file's 17,316 training-split conversations open with a held-out prompt, "hi" 65 times), and a
    regenerated reply to a benchmark prompt in the training data would inflate its acceptance."""
    openings = _openings(conversations, held_out=True)

    def held(conv: dict[str, Any]) -> bool:
        p = opening_prompt(conv)
        return heldout(str(conv.get("id", ""))) or (p is not None and not openings.isdisjoint(prompt_marks(p)))

    return held


def first_user_turns(conversations: Iterable[dict[str, Any]] | ShareGPT, heldout_only: bool = True,
                     limit: int | None = None) -> list[str]:
    """The opening user turn of each conversation, in file order, duplicates removed.

    A conversation counts only if its first turn after any system turns is a non-empty user
    turn: later parts of a split conversation open with the assistant, and their first user
    turn ("continue") means nothing without what came before. With ``heldout_only`` (the
    default, for benchmarks) only held-out conversations are used, less those whose prompt also
    opens a training-split conversation (``prompt_marks``): training data built before
    ``held_out_filter`` existed, or by another tool from the same file, may hold its reply.
    """
    if isinstance(conversations, ShareGPT):
        conversations = conversations.conversations
    conversations = list(conversations)
    trained = _openings(conversations, held_out=False) if heldout_only else set()
    prompts: list[str] = []
    seen: set[str] = set()
    for conv in conversations:
        if limit is not None and len(prompts) >= limit:
            break
        if heldout_only and not heldout(conv.get("id", "")):
            continue
        value = opening_prompt(conv)
        if value is not None and not trained.isdisjoint(prompt_marks(value)):
            continue
        if value is not None and value not in seen:
            seen.add(value)
            prompts.append(value)
    return prompts


def training_exchanges(corpus: ShareGPT, first: int, later: int = 0, single: int = 0) -> list[dict[str, Any]]:
    """Short training-split conversations for regeneration, in this order (the order a time budget
    cuts from the end): ``first`` first exchanges (a user turn and its reply); ``single`` user turns
    from further in, each alone with its reply as an exchange of its own, every one a prompt that no
    first exchange taken and no other single opens with (``prompt_marks``); then ``later`` exchanges
    from further in: the first two exchanges of conversations that have them (the second reply
    learnt after the first), or the first exchange of a conversation part that opens with a reply
    (its earlier turns are in another part). Held-out conversations, and those opening with a
    held-out prompt, are never taken, nor a single whose prompt is a held-out opening
    (``held_out_filter``). Regenerating a whole conversation costs one generation per reply:
    exchanges keep that small, and a single costs one generation for one new reply where a later
    exchange costs two (its first reply is the first exchange's, regenerated again)."""
    held = held_out_filter(corpus)
    firsts, singles, laters = [], [], []
    for conv in corpus.conversations:
        turns = conv.get("conversations") or []
        who = [t.get("from") if isinstance(t, dict) else None for t in turns]
        if held(conv) or len(turns) < 2:
            continue
        if who[:1] == ["human"] and len(firsts) < first:
            firsts.append({"id": conv["id"], "conversations": turns[:2]})
        if len(laters) >= later:
            continue
        if who[:4] == ["human", "gpt", "human", "gpt"]:
            laters.append({"id": f"{conv['id']}#2", "conversations": turns[:4]})
        elif who[:1] == ["gpt"] and "human" in who:
            i = who.index("human")
            if who[i + 1:i + 2] == ["gpt"]:
                laters.append({"id": f"{conv['id']}#p", "conversations": turns[i:i + 2]})
    if single:
        taken = {m for ex in firsts for m in prompt_marks(ex["conversations"][0].get("value") or "")}
        taken |= _openings(corpus, held_out=True)
        for conv in corpus.conversations:
            if len(singles) >= single:
                break
            turns = conv.get("conversations") or []
            if held(conv):
                continue
            for i in range(1, len(turns) - 1):
                ask, reply = turns[i], turns[i + 1]
                if not (isinstance(ask, dict) and isinstance(reply, dict) and ask.get("from") == "human"
                        and reply.get("from") == "gpt" and isinstance(ask.get("value"), str) and ask["value"].strip()):
                    continue
                marks = prompt_marks(ask["value"])
                if taken.isdisjoint(marks) and len(singles) < single:
                    taken |= marks
                    singles.append({"id": f"{conv['id']}#s{i}", "conversations": [ask, reply]})
    return firsts + singles + laters


def deeper_exchanges(corpus: ShareGPT, exchanges: Iterable[int] = (3, 4, 5)) -> list[dict[str, Any]]:
    """Training-split exchanges deeper in a conversation: for each n in ``exchanges``, the first 2n
    turns of every conversation whose first 2n turns alternate human, gpt (regeneration replaces
    every reply in order, each the context of the next)."""
    held = held_out_filter(corpus.conversations)
    out = []
    for n in exchanges:
        for conv in corpus.conversations:
            turns = conv.get("conversations") or []
            if held(conv) or len(turns) < 2 * n:
                continue
            if all(t.get("from") == ("human", "gpt")[i % 2] for i, t in enumerate(turns[:2 * n])):
                out.append({"id": f"{conv['id']}#{n}", "conversations": turns[:2 * n]})
    return out
