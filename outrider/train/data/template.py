"""The target's chat template -> token ids and assistant loss masks.

Contract: masks come from the target's own chat template, never from separator strings written
here. For assistant turn ``i`` the template renders ``messages[:i]`` with the generation prompt
(text ``P``) and ``messages[:i+1]`` (text ``Q``); the turn is ``Q[len(P):]``. Texts are cut at
these boundaries, each piece is tokenised, and the concatenation is verified against the
tokenisation of the whole rendering (if it differs, boundaries are recovered by tokenising
prefixes; if that fails too the conversation is dropped). No offset mapping is needed, so
tokenizers without one (Kimi's tiktoken) work. Inside a turn the mask is 1 up to and including the
last end-of-turn token, 0 after it. A template that renders a reply differently once later turns
follow is not split across turns: only the last reply that fits is learned, after its context.
``vocab_identity`` hashes a loaded tokenizer's vocabulary and template (a dataset's pin).
``tokenize_many`` does the same for many conversations, in order, over worker processes when
there are enough of them (each worker gets the pickled tokenizer: the same vocabulary and template)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from outrider.errors import UserError
from outrider.train.data.conversations import Conversation, Dropped

PARALLEL_MIN = 4096  # conversations below which tokenising stays in this process (workers cost a start)
CHUNK = 512  # conversations per worker task, at least

# --------------------------------------------------------------------------------------------
# The target's chat template -> ids and masks


def vocab_identity(tokenizer) -> dict[str, Any]:
    """Identity of a tokenizer: name, size, hash of its vocabulary and of its chat template."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    template = tokenizer.chat_template
    template_text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return {
        "name": str(getattr(tokenizer, "name_or_path", "") or ""),
        "vocab_size": len(tokenizer),
        "vocab_hash": hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest(),
        "chat_template_hash": hashlib.sha256((template_text or "").encode()).hexdigest(),
    }


def require_chat_template(tokenizer, target: str = "the target") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer of {target} has no chat template: use a chat (instruct) model, "
                        "or add 'chat_template' to its tokenizer_config.json")


def end_token_ids(tokenizer, model_dir: str | Path | None = None) -> list[int]:
    """End-of-turn ids: the tokenizer's EOS plus ``generation_config.json``'s ``eos_token_id``."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None and Path(model_dir).is_dir():
        gen = Path(model_dir) / "generation_config.json"
        if gen.exists():
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
            except (OSError, json.JSONDecodeError):
                eos = None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos if isinstance(e, int))
    return sorted(ids)


def render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    from jinja2.exceptions import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError):
        raise Dropped("template_error") from None
    if not isinstance(text, str):
        raise Dropped("template_error")
    return text


def encode(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False, verbose=False)]


def control_strings(tokenizer) -> list[str]:
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content))
    return sorted(s for s in specials if s)


def without_control_text(conversations: list[Conversation], controls: list[str],
                          dropped: Counter) -> list[Conversation]:
    """Drop conversations whose text spells a special token (it would encode as a control token)."""
    kept = []
    for conv in conversations:
        if any(c in m["content"] for m in conv.messages for c in controls):
            dropped["control_token_in_text"] += 1
        else:
            kept.append(conv)
    return kept


def _turn_mask(ids: list[int], end_ids: set[int]) -> list[int]:
    """1 up to and including the last end-of-turn token of an assistant turn, 0 after it."""
    last = max((k for k, t in enumerate(ids) if t in end_ids), default=len(ids) - 1)
    return [1] * (last + 1) + [0] * (len(ids) - last - 1)


class Tokenized(NamedTuple):
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool  # something that would have been learned was cut by max_length
    last_turn_only: bool = False  # the template is not prefix-stable: only the last fitting turn is learned


def _split_by_prefixes(tokenizer, text: str, pieces: list[str], full_ids: list[int]) -> list[list[int]]:
    """Token pieces of ``text`` at the piece boundaries, by tokenising each prefix."""
    out, start, end = [], 0, 0
    for piece in pieces[:-1]:
        end += len(piece)
        prefix = encode(tokenizer, text[:end])
        if len(prefix) < start or full_ids[: len(prefix)] != prefix:
            raise Dropped("tokenization_mismatch")
        out.append(full_ids[start: len(prefix)])
        start = len(prefix)
    out.append(full_ids[start:])
    return out


def _assemble(tokenizer, done: str, texts: list[str], token_pieces: list[list[int]], end: set[int],
              max_length: int, truncated: bool, last_turn_only: bool) -> Tokenized:
    """Verify the pieces against the whole rendering ``done``, then build ids and mask."""
    full = encode(tokenizer, done)  # the verification: pieces must re-tokenise to the whole
    if [t for piece in token_pieces for t in piece] != full:
        token_pieces = _split_by_prefixes(tokenizer, done, texts, full)
    ids: list[int] = []
    mask: list[int] = []
    for k, piece in enumerate(token_pieces):  # odd pieces are assistant turns
        ids += piece
        mask += _turn_mask(piece, end) if k % 2 == 1 and piece else [0] * len(piece)
    truncated = truncated or len(ids) > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise Dropped("nothing_to_learn")
    return Tokenized(ids, mask, truncated, last_turn_only)


def _last_turn_only(tokenizer, messages: list[dict[str, str]], assistant_at: list[int], max_length: int,
                    end: set[int]) -> Tokenized:
    """For templates that render a turn differently once later turns follow (e.g. a thinking block
    kept only on the final reply): the last assistant turn that starts within ``max_length``,
    learned in the form the template gives a final reply, after its context (not learned)."""
    for i in reversed(assistant_at):
        prompt = render(tokenizer, messages[:i], True)
        turn = render(tokenizer, messages[: i + 1], False)
        if not turn.startswith(prompt):
            continue
        head = encode(tokenizer, prompt)
        if len(head) >= max_length:
            continue
        body = encode(tokenizer, turn[len(prompt):])
        return _assemble(tokenizer, turn, [prompt, turn[len(prompt):]], [head, body], end, max_length,
                         i != assistant_at[-1], True)
    raise Dropped("template_not_prefix_stable")


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_length: int,
                          end_ids: Iterable[int] = ()) -> Tokenized:
    """Render with the tokenizer's chat template; mask the assistant turns. Raises ``Dropped``.

    Turns that would start at or beyond ``max_length`` tokens are not rendered at all. When the
    template is not prefix-stable across turns, only the last turn that fits is learned
    (``Tokenized.last_turn_only``).
    """
    end = set(int(e) for e in end_ids)
    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_at:
        raise Dropped("no_assistant_turn")
    texts: list[str] = []  # alternating: context, assistant turn, context, assistant turn, ...
    token_pieces: list[list[int]] = []
    done, n_tokens, truncated = "", 0, False
    for i in assistant_at:
        prompt = render(tokenizer, messages[:i], True)
        turn = render(tokenizer, messages[: i + 1], False)
        if not prompt.startswith(done) or not turn.startswith(prompt):
            return _last_turn_only(tokenizer, messages, assistant_at, max_length, end)
        head = encode(tokenizer, prompt[len(done):])
        if n_tokens + len(head) >= max_length:
            truncated = True
            break
        body = encode(tokenizer, turn[len(prompt):])
        texts += [prompt[len(done):], turn[len(prompt):]]
        token_pieces += [head, body]
        n_tokens += len(head) + len(body)
        done = turn
        if n_tokens >= max_length:
            truncated = truncated or i != assistant_at[-1] or n_tokens > max_length
            break
    if not texts:
        raise Dropped("nothing_to_learn")
    return _assemble(tokenizer, done, texts, token_pieces, end, max_length, truncated, False)


def _tokenize_chunk(tokenizer, chunk: Sequence[list[dict[str, str]]], max_length: int,
                    end_ids: Sequence[int]) -> list["Tokenized | str"]:
    """``tokenize_conversation`` over ``chunk``: a ``Tokenized``, or the ``Dropped`` reason, per conversation."""
    out: list[Tokenized | str] = []
    for messages in chunk:
        try:
            out.append(tokenize_conversation(tokenizer, messages, max_length, end_ids))
        except Dropped as d:
            out.append(d.reason)
    return out


def tokenize_many(tokenizer, conversations: Sequence[list[dict[str, str]]], max_length: int,
                  end_ids: Iterable[int] = (), workers: int = 1,
                  advance: Callable[[int], None] = lambda n: None) -> list["Tokenized | str"]:
    """``tokenize_conversation`` of every conversation (its messages), in order: a ``Tokenized`` or
    the reason it was dropped. ``workers``: processes (1: this process; 0: one per CPU this process
    may use, up to 16, once there are ``PARALLEL_MIN`` conversations). Workers are spawned, so the
    caller's main module must guard its top-level code (the CLI's does); where they cannot start
    or the tokenizer cannot be sent to them, one line on stderr says so and the rest is tokenised
    here, to the same result. ``advance(n)`` is called as n more are done."""
    end = sorted(int(e) for e in end_ids)
    if workers == 0:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = min(cpus, 16) if len(conversations) >= PARALLEL_MIN else 1
    size = max(CHUNK, -(-len(conversations) // (4 * workers)))  # about 4 tasks a worker: the tokenizer travels with each
    chunks = [conversations[i:i + size] for i in range(0, len(conversations), size)]
    out: list[Tokenized | str] = []
    finished = 0  # chunks done by the workers
    if workers > 1 and len(chunks) > 1:
        spawn = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA or threads
        try:
            with ProcessPoolExecutor(max_workers=min(workers, len(chunks)), mp_context=spawn) as pool:
                n = len(chunks)
                for done in pool.map(_tokenize_chunk, [tokenizer] * n, chunks, [max_length] * n, [end] * n):
                    out += done
                    advance(len(chunks[finished]))
                    finished += 1
        except (BrokenProcessPool, OSError, pickle.PicklingError, TypeError, AttributeError) as e:
            # e.g. a main module without a guard, no shared memory, a tokenizer that cannot be pickled
            print(f"tokenising in this process: its {workers} workers could not run ({type(e).__name__})",
                  file=sys.stderr)
    for chunk in chunks[finished:]:
        out += _tokenize_chunk(tokenizer, chunk, max_length, end)
        advance(len(chunk))
    return out
