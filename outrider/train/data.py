"""Conversations -> token ids + assistant loss masks, stored as Parquet shards with a manifest.

Contract:
- Reading. ShareGPT records (``conversations: [{from: human|gpt|system, value}]``) and OpenAI
  records (``messages: [{role, content}]``), from a JSON list or a JSONL file, or the embedded
  ShareGPT (``dataset='sharegpt'``, through ``outrider.assets.load_sharegpt``, whose held-out
  conversations, reserved for benchmarks, are never used for training). Every record becomes
  ``[{role, content}]`` with roles ``system``/``user``/``assistant``. Assistant turns that come
  before any user turn are removed (a reply to nothing). A record that cannot be used is skipped
  and counted under a reason; a file with nothing usable is a ``UserError``.
- Masks come from the target's own chat template, never from separator strings written here.
  For assistant turn ``i`` the template renders ``messages[:i]`` with the generation prompt
  (text ``P``) and ``messages[:i+1]`` (text ``Q``); the turn is ``Q[len(P):]``. Texts are cut at
  these boundaries, each piece is tokenised, and the concatenation is verified against the
  tokenisation of the whole rendering (if it differs, boundaries are recovered by tokenising
  prefixes; if that fails too the conversation is dropped). No offset mapping is needed, so
  tokenizers without one (Kimi's tiktoken) work. Inside a turn the mask is 1 up to and including
  the last end-of-turn token (the tokenizer's EOS and the model's ``generation_config`` EOS ids),
  0 after it (e.g. a newline the template adds after the end token, which the model never emits).
  A template that renders a reply differently once later turns follow (``Q_i`` is not a prefix
  of ``P_{i+1}``, as when a thinking block is kept only on the final reply) is not split across
  turns: only the last reply that fits is learned, in its final form, after its context.
- Sequences are cut to ``max_length`` tokens; a conversation with no masked token left is dropped,
  and so is one whose tokens an earlier one already has (sources repeat conversations under other
  ids: such a copy would train twice, or sit on both sides of the split). Train/eval split by a
  seeded permutation. Output directory (written atomically): shards
  ``{train,eval}-NNNNN.parquet`` with columns ``input_ids list<int32>``, ``loss_mask list<int8>``
  (aligned with ``input_ids``: ``loss_mask[t] = 1`` iff token ``t`` is an assistant token the
  model must learn to predict from the tokens before it), ``conv_id string``; and
  ``manifest.json`` (tokenizer fingerprint, chat-template hash, counts, drop reasons, shards).
- ``regenerate=True`` replaces each assistant turn, in order, with the target's own greedy reply
  to the conversation so far (``temperature > 0``: a reply sampled at that temperature, no top-k
  or top-p, seeded by ``seed``), through a local ``generate_fn(prompts, max_new_tokens)`` (token
  ids in, new token ids out; prompts go in waves of similar length, one wave per
  ``generate_fn.batch_size`` when it declares one; it samples at ``generate_fn.temperature`` with
  ``generate_fn.seed``, 0 when it declares none, which must be the ones asked) or an
  OpenAI-compatible server (each request seeded from ``seed``, the conversation and the turn).
  Locally the draws depend on how replies were batched: a resumed run samples the rest afresh.
  Finished conversations are appended to a JSONL cache next to the output (``<out>.regen.jsonl``)
  and reused on a rerun with the same settings, so an interrupted run resumes. A reply cut at ``max_new_tokens`` is stored as if it
  had ended there (the template closes it); turns whose prompt already fills ``max_length`` are
  not generated. Server-side refusals (HTTP 4xx) end that conversation at the refused turn.
- ``load_dataset(dir)`` -> ``TokenDataset``: examples and deterministic shuffled, padded batches,
  shardable by rank. ``merge_datasets(dirs, out)`` joins datasets of one tokenizer (each split
  with its own; an example whose tokens were seen before is dropped).

Not done here: packing several conversations into one sequence, tool-call or multimodal turns,
top-k or top-p during regeneration, sanitising control tokens inside message text
(conversations whose text contains one of the tokenizer's special tokens are dropped instead).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from outrider.errors import UserError
from outrider.fsutil import atomic_dir
from outrider.progress import Bar
from outrider.sampling import derived_seed

FORMAT = "outrider-tokens"
VERSION = 1
GenerateFn = Callable[[list[list[int]], int], list[list[int]]]

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
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{p} is not a text file: give a .json or .jsonl file of conversations") from None
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


def _load_source(dataset: str, max_conversations: int | None) -> _Source:
    """Read, normalise and limit the conversations; held-out ShareGPT ones are excluded (by id, or
    opening with a held-out prompt: ``assets.held_out_filter``)."""
    exclude: Callable[[dict], bool] | None = None  # held out for benchmarks (the embedded ShareGPT)
    note = ""
    if dataset == "sharegpt":
        from outrider import assets

        sg = assets.load_sharegpt()
        records = list(sg.conversations)
        exclude = assets.held_out_filter(records)
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


# --------------------------------------------------------------------------------------------
# The target's chat template -> ids and masks


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
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


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    from jinja2.exceptions import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError):
        raise Dropped("template_error") from None
    if not isinstance(text, str):
        raise Dropped("template_error")
    return text


def _encode(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False, verbose=False)]


def _control_strings(tokenizer) -> list[str]:
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content))
    return sorted(s for s in specials if s)


def _without_control_text(conversations: list[Conversation], controls: list[str],
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
        prefix = _encode(tokenizer, text[:end])
        if len(prefix) < start or full_ids[: len(prefix)] != prefix:
            raise Dropped("tokenization_mismatch")
        out.append(full_ids[start: len(prefix)])
        start = len(prefix)
    out.append(full_ids[start:])
    return out


def _assemble(tokenizer, done: str, texts: list[str], token_pieces: list[list[int]], end: set[int],
              max_length: int, truncated: bool, last_turn_only: bool) -> Tokenized:
    """Verify the pieces against the whole rendering ``done``, then build ids and mask."""
    full = _encode(tokenizer, done)  # the verification: pieces must re-tokenise to the whole
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
        prompt = _render(tokenizer, messages[:i], True)
        turn = _render(tokenizer, messages[: i + 1], False)
        if not turn.startswith(prompt):
            continue
        head = _encode(tokenizer, prompt)
        if len(head) >= max_length:
            continue
        body = _encode(tokenizer, turn[len(prompt):])
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
        prompt = _render(tokenizer, messages[:i], True)
        turn = _render(tokenizer, messages[: i + 1], False)
        if not prompt.startswith(done) or not turn.startswith(prompt):
            return _last_turn_only(tokenizer, messages, assistant_at, max_length, end)
        head = _encode(tokenizer, prompt[len(done):])
        if n_tokens + len(head) >= max_length:
            truncated = True
            break
        body = _encode(tokenizer, turn[len(prompt):])
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


# --------------------------------------------------------------------------------------------
# Regeneration: the target's own replies, locally or through a server


class _Cache:
    """Append-only JSONL of finished conversations: ``{conv_id, key, responses, stop}``."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._file = None
        if path.exists():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by an interrupted run
                    continue
                if isinstance(entry, dict) and "conv_id" in entry and isinstance(entry.get("responses"), list):
                    self.entries[str(entry["conv_id"])] = entry

    def get(self, conv_id: str, key: str) -> dict[str, Any] | None:
        entry = self.entries.get(conv_id)
        return entry if entry is not None and entry.get("key") == key else None

    def put(self, conv_id: str, key: str, responses: list[str], stop: str | None) -> None:
        entry = {"conv_id": conv_id, "key": key, "responses": responses, "stop": stop}
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a+b")
                self._file.seek(0, 2)
                if self._file.tell() > 0:
                    self._file.seek(-1, 2)
                    if self._file.read(1) != b"\n":
                        self._file.write(b"\n")
            self._file.write((json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8"))
            self._file.flush()
            self.entries[conv_id] = entry

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _apply_responses(messages: list[dict[str, str]], responses: list[str]) -> list[dict[str, str]]:
    """Replace the first ``len(responses)`` assistant turns; cut everything after the last one."""
    out, k = [], 0
    for m in messages:
        if m["role"] == "assistant":
            if k == len(responses):
                break
            out.append({"role": "assistant", "content": responses[k]})
            k += 1
        else:
            out.append(dict(m))
    while out and out[-1]["role"] != "assistant":
        out.pop()
    return out


def _cut_at_end(ids: Sequence[int], end: set[int]) -> list[int]:
    out = []
    for t in ids:
        if t in end:
            break
        out.append(int(t))
    return out


def hf_generate_fn(model, pad_token_id: int, end_ids: Iterable[int], batch_size: int = 8,
                   temperature: float = 0.0, seed: int = 0) -> GenerateFn:
    """A ``generate_fn`` from a Hugging Face causal LM: ``model.generate``, left-padded batches; greedy,
    or sampled at ``temperature`` (> 0) from the whole distribution, batch i drawing from the
    model device's default generator seeded ``derived_seed(seed, i)`` (restored afterwards)."""
    from transformers import GenerationConfig

    end = sorted(set(int(e) for e in end_ids))
    batches = 0  # batches generated so far: the next one's seed offset

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        nonlocal batches
        device = next(model.parameters()).device
        cuda = device.type == "cuda"
        index = torch.cuda.current_device() if cuda and device.index is None else device.index
        out: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        sampled = {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0,
                   "typical_p": 1.0, "repetition_penalty": 1.0}  # none of the model's own settings
        config = GenerationConfig(**(sampled if temperature > 0 else {"do_sample": False}),
                                  max_new_tokens=int(max_new_tokens), pad_token_id=pad_token_id,
                                  eos_token_id=end or None)
        for start in range(0, len(order), batch_size):
            chunk = order[start: start + batch_size]
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)  # [batch, seq]
            attn = torch.zeros((len(chunk), width), dtype=torch.long)  # [batch, seq]
            for row, i in enumerate(chunk):
                n = len(prompts[i])
                ids[row, width - n:] = torch.tensor(prompts[i], dtype=torch.long)
                attn[row, width - n:] = 1
            with torch.no_grad(), torch.random.fork_rng(devices=[index] if cuda else []):
                # only the generator that samples is reseeded: the one fork_rng restores
                gen_state = torch.cuda.default_generators[index] if cuda else torch.default_generator
                gen_state.manual_seed(derived_seed(seed, batches, 63))
                gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                     generation_config=config)  # [batch, width + new]
            batches += 1
            for row, i in enumerate(chunk):
                out[i] = [int(t) for t in gen[row, width:].tolist()]
        return out

    generate.batch_size = batch_size  # the regeneration's wave size
    generate.temperature = float(temperature)
    generate.seed = seed
    return generate


@dataclass
class _RegenResult:
    responses: list[str]
    stop: str | None  # why it stopped before the last assistant turn: max_length, server_rejected, ...


def _regen_local(todo: list[tuple[Conversation, str]], tokenizer, generate_fn: GenerateFn, max_new_tokens: int,
                 max_length: int, end: set[int], cache: _Cache, bar: Bar, wave: int = 64) -> dict[str, _RegenResult]:
    """Turn by turn, batched across conversations: round r generates every conversation's r-th reply."""
    results: dict[str, _RegenResult] = {}

    def finish(conv: Conversation, key: str, responses: list[str], stop: str | None) -> None:
        cache.put(conv.conv_id, key, responses, stop)
        results[conv.conv_id] = _RegenResult(responses, stop)
        bar.advance()

    active = [(conv, key, copy.deepcopy(conv.messages), [i for i, m in enumerate(conv.messages)
                                                           if m["role"] == "assistant"], [])
              for conv, key in todo]
    while active:
        ready = []
        for state in active:
            conv, key, msgs, turns, responses = state
            i = turns[len(responses)]
            try:
                prompt = _encode(tokenizer, _render(tokenizer, msgs[:i], True))
            except Dropped as d:
                finish(conv, key, responses, d.reason)
                continue
            if len(prompt) >= max_length:
                finish(conv, key, responses, "max_length")
                continue
            ready.append((state, i, prompt))
        active = []
        ready.sort(key=lambda r: len(r[2]))  # waves of similar lengths: little padding, steady cache sizes
        wave = getattr(generate_fn, "batch_size", wave)  # one wave = one batch of the generator
        for start in range(0, len(ready), wave):
            chunk = ready[start: start + wave]
            outs = generate_fn([p for _, _, p in chunk], max_new_tokens)
            if len(outs) != len(chunk):
                raise RuntimeError(f"generate_fn returned {len(outs)} outputs for {len(chunk)} prompts")
            for (state, i, _), out in zip(chunk, outs):
                conv, key, msgs, turns, responses = state
                text = tokenizer.decode(_cut_at_end(out, end), skip_special_tokens=True)
                msgs[i] = {"role": "assistant", "content": text}
                responses.append(text)
                if len(responses) == len(turns):
                    finish(conv, key, responses, None)
                else:
                    active.append(state)
    return results


def _regen_server(todo: list[tuple[Conversation, str]], tokenizer, client, max_new_tokens: int, max_length: int,
                  concurrency: int, cache: _Cache, bar: Bar, temperature: float = 0.0,
                  seed: int = 0) -> dict[str, _RegenResult]:
    """One thread per conversation in flight; each conversation goes turn by turn."""
    from outrider.train.openai_client import ServerRejected

    tok_lock = threading.Lock()  # tokenizers are not guaranteed thread-safe

    def work(conv: Conversation, key: str) -> _RegenResult:
        msgs = copy.deepcopy(conv.messages)
        responses: list[str] = []
        stop = None
        for i, m in enumerate(conv.messages):
            if m["role"] != "assistant":
                continue
            with tok_lock:
                try:
                    n_prompt = len(_encode(tokenizer, _render(tokenizer, msgs[:i], True)))
                except Dropped as d:
                    stop = d.reason
                    break
            if n_prompt >= max_length:
                stop = "max_length"
                break
            try:
                text = client.chat(msgs[:i], max_new_tokens, temperature,
                                   seed=derived_seed(seed, f"{key}:{i}", 31) if temperature else None)
            except ServerRejected:
                stop = "server_rejected"
                break
            msgs[i] = {"role": "assistant", "content": text}
            responses.append(text)
        cache.put(conv.conv_id, key, responses, stop)
        return _RegenResult(responses, stop)

    results: dict[str, _RegenResult] = {}
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = {pool.submit(work, conv, key): conv.conv_id for conv, key in todo}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            bar.advance()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results


def _regen_key(backend: str, conv: Conversation, max_new_tokens: int, max_length: int, template_hash: str,
               temperature: float = 0.0, seed: int = 0) -> str:
    # greedy keys stay as they were before sampling existed, so that earlier caches still serve
    sampled = [temperature, seed] if temperature else []
    settings = [backend, conv.messages, max_new_tokens, max_length, template_hash] + sampled
    blob = json.dumps(settings, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]


def cache_path_for(out: str | Path) -> Path:
    """Where the regeneration cache of an output directory lives (a sibling, kept across runs)."""
    out = Path(out).expanduser()
    return out.parent / f"{out.name}.regen.jsonl"


# --------------------------------------------------------------------------------------------
# Writing and reading the token dataset


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("token datasets are stored as Parquet: install pyarrow "
                        "(pip install 'outrider[data]')") from None
    return pa, pq


def _write_split(directory: Path, split: str, rows: list[tuple[str, list[int], list[int]]],
                 shard_rows: int) -> list[dict[str, Any]]:
    pa, pq = _pyarrow()
    shards = []
    for k, start in enumerate(range(0, len(rows), shard_rows)):
        chunk = rows[start: start + shard_rows]
        lengths = np.array([len(ids) for _, ids, _ in chunk], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = np.fromiter((t for _, row, _ in chunk for t in row), dtype=np.int32, count=int(lengths.sum()))
        mask = np.fromiter((t for _, _, row in chunk for t in row), dtype=np.int8, count=int(lengths.sum()))
        table = pa.table({
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, type=pa.int32())),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask, type=pa.int8())),
            "conv_id": pa.array([c for c, _, _ in chunk], type=pa.string()),
        })
        name = f"{split}-{k:05d}.parquet"
        pq.write_table(table, directory / name)
        shards.append({"file": name, "examples": len(chunk), "tokens": int(lengths.sum()),
                       "loss_tokens": int(mask.sum(dtype=np.int64))})
    return shards


def _write_dataset(out: Path, manifest: dict[str, Any], rows: dict[str, list[tuple[str, list[int], list[int]]]],
                   shard_rows: int) -> None:
    """Both splits' shards and ``manifest.json`` (its ``splits`` filled in here) into ``out``, atomically."""
    with atomic_dir(out) as tmp:
        for split in ("train", "eval"):
            shards = _write_split(tmp, split, rows[split], shard_rows)
            manifest["splits"][split] = {"examples": len(rows[split]), "tokens": sum(s["tokens"] for s in shards),
                                         "loss_tokens": sum(s["loss_tokens"] for s in shards), "shards": shards}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(directory: str | Path) -> dict[str, Any]:
    d = Path(directory).expanduser()
    path = d / "manifest.json"
    if not path.exists():
        raise UserError(f"{d} is not an outrider token dataset (no manifest.json): build one with `outrider data`")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{path} is not an {FORMAT} v{VERSION} manifest: rebuild the data with `outrider data`")
    return manifest


@dataclass
class Batch:
    input_ids: torch.Tensor  # [batch, seq] int64, right-padded with the pad id
    attention_mask: torch.Tensor  # [batch, seq] int64, 1 on real tokens, 0 on padding
    loss_mask: torch.Tensor  # [batch, seq] int64, 1 on assistant tokens to learn (never on padding)
    indices: torch.Tensor  # [batch] int64, example indices in the dataset

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(*(to_device(t, device, non_blocking)
                       for t in (self.input_ids, self.attention_mask, self.loss_mask, self.indices)))


def to_device(t: torch.Tensor, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for CUDA with ``non_blocking`` goes through pinned
    memory, so that the copy is queued behind the device's work instead of waiting for it."""
    if non_blocking and t.device.type == "cpu" and torch.device(device).type == "cuda":
        t = t.contiguous().pin_memory()  # a strided pinned copy would be staged through pageable memory
    return t.to(device, non_blocking=non_blocking)


class TokenDataset:
    """One split of a token dataset in memory: ``ds[i] -> (input_ids [seq], loss_mask [seq])``."""

    def __init__(self, input_ids: list[np.ndarray], loss_mask: list[np.ndarray], conv_ids: list[str],
                 manifest: dict[str, Any], split: str = "train"):
        self.input_ids = input_ids
        self.loss_mask = loss_mask
        self.conv_ids = conv_ids
        self.manifest = manifest
        self.split = split
        self.pad_token_id = int(manifest.get("tokenizer", {}).get("pad_token_id") or 0)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.from_numpy(self.input_ids[i].astype(np.int64)),  # [seq]
                torch.from_numpy(self.loss_mask[i].astype(np.int64)))  # [seq]

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self.input_ids], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(int(m.sum(dtype=np.int64)) for m in self.loss_mask))

    def check_tokenizer(self, tokenizer) -> None:
        """``UserError`` unless ``tokenizer`` is the one the data was built with."""
        want = self.manifest.get("tokenizer", {}).get("vocab_hash")
        have = tokenizer_fingerprint(tokenizer)["vocab_hash"]
        if want != have:
            raise UserError(f"the data was tokenised with {self.manifest['tokenizer'].get('name')!r}, whose vocabulary "
                            "differs from this target's: rebuild it with `outrider data` for this target")

    def order(self, seed: int, epoch: int = 0) -> np.ndarray:
        """The shuffled example order of one epoch; a function of (seed, epoch) only."""
        return np.random.default_rng([int(seed), int(epoch)]).permutation(len(self))

    def num_batches(self, batch_size: int, world_size: int = 1, drop_last: bool = True) -> int:
        g = batch_size * world_size
        return len(self) // g if drop_last else -(-len(self) // g)

    def collate(self, indices: Sequence[int], pad_to_multiple_of: int = 1) -> Batch:
        idx = [int(i) for i in indices]
        width = max((len(self.input_ids[i]) for i in idx), default=0)
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        ids = torch.full((len(idx), width), self.pad_token_id, dtype=torch.long)  # [batch, seq]
        attn = torch.zeros((len(idx), width), dtype=torch.long)  # [batch, seq]
        mask = torch.zeros((len(idx), width), dtype=torch.long)  # [batch, seq]
        for row, i in enumerate(idx):
            n = len(self.input_ids[i])
            ids[row, :n] = torch.from_numpy(self.input_ids[i].astype(np.int64))
            attn[row, :n] = 1
            mask[row, :n] = torch.from_numpy(self.loss_mask[i].astype(np.int64))
        return Batch(ids, attn, mask, torch.tensor(idx, dtype=torch.long))

    def batches(self, batch_size: int, seed: int = 0, epoch: int = 0, start: int = 0, rank: int = 0,
                world_size: int = 1, drop_last: bool = True, pad_to_multiple_of: int = 1,
                group_by_length: int = 0, batch_tokens: int = 0, cap: int = 0, min_tokens: int = 0
                ) -> Iterator[Batch]:
        """Batches of one epoch, from batch number ``start`` (to resume mid-epoch).

        Step ``s`` takes global batch ``s`` of ``global_batches`` (``G = batch_size * world_size``
        examples each, or a budget of ``batch_tokens * world_size`` padded tokens, or short neighbours
        joined up to ``min_tokens * world_size``); rank ``r`` gets
        its elements ``r, r + world_size, ...``. The union over ranks is the batch a single process
        with ``batch_size = G`` sees. With ``drop_last=False`` the final global batch may be short,
        and a rank's share of it may be empty.
        """
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batching: batch_size={batch_size} rank={rank} world_size={world_size}")
        plan = self.global_batches(batch_size * world_size, seed, epoch, drop_last, group_by_length,
                                   batch_tokens * world_size, cap, pad_to_multiple_of, world_size,
                                   min_tokens * world_size)
        for s in range(start, len(plan)):
            yield self.collate(plan[s][rank::world_size], pad_to_multiple_of)

    def global_batches(self, g: int, seed: int = 0, epoch: int = 0, drop_last: bool = True,
                       group_by_length: int = 0, tokens: int = 0, cap: int = 0, multiple: int = 1,
                       world_size: int = 1, min_tokens: int = 0) -> list[np.ndarray]:
        """The example indices of every global batch of one epoch; a function of (seed, epoch).

        By count (``tokens = 0``): batch ``s`` is ``order[s*g:(s+1)*g]``. With ``group_by_length =
        m > 1`` each window of ``m`` consecutive batches is sorted by length before it is cut
        (similar lengths share a batch: little padding), and the batches are then shuffled again.
        With ``min_tokens > 0`` as well, neighbours in that length order whose padded size (count x
        the widest) is below ``min_tokens`` are joined until the union reaches it, never past
        ``2 * min_tokens``: whole batches of ``g``, so that ranks still split them evenly.

        By tokens (``tokens > 0``): each batch takes the next examples while their padded size
        (count x the widest, lengths cut at ``cap`` and padded to a ``multiple``) stays within
        ``tokens``; the count is then rounded down to a multiple of ``8 * world_size`` (or of
        ``world_size``), so that few distinct batch shapes occur (attention kernels plan per shape).
        An example wider than the budget forms a batch of ``world_size``; the last batch may be
        short (``drop_last`` drops it only below ``world_size``). Windows of ``m *
        tokens`` padded tokens are sorted by length, and the batches shuffled, as above.
        """
        order = self.order(seed, epoch)
        if tokens > 0:
            return self._token_batches(order, tokens, group_by_length, cap, multiple, world_size, drop_last,
                                       np.random.default_rng([int(seed), int(epoch), 1]))
        full = len(self) // g * g
        if group_by_length > 1:
            lengths = self.lengths
            windows = [order[i:min(i + group_by_length * g, full)] for i in range(0, full, group_by_length * g)]
            order = np.concatenate([w[np.argsort(lengths[w], kind="stable")] for w in windows] + [order[full:]])
        plan = [order[i:i + g] for i in range(0, full, g)]
        if group_by_length > 1:
            if min_tokens > 0:
                plan = self._joined(plan, min_tokens, cap, multiple)
            plan = [plan[i] for i in np.random.default_rng([int(seed), int(epoch), 1]).permutation(len(plan))]
        if not drop_last and full < len(self):
            plan.append(order[full:])
        return plan

    def _widths(self, cap: int, multiple: int) -> tuple[np.ndarray, np.ndarray]:
        """Lengths cut at ``cap`` [N], and the padded width of each example alone [N]."""
        lengths = np.minimum(self.lengths, cap) if cap > 0 else self.lengths
        return lengths, -(-lengths // multiple) * multiple

    def _joined(self, plan: list[np.ndarray], min_tokens: int, cap: int, multiple: int) -> list[np.ndarray]:
        """Consecutive batches below ``min_tokens`` padded tokens joined (see ``global_batches``)."""
        _, width = self._widths(cap, multiple)

        def size(rows: np.ndarray) -> int:
            return len(rows) * int(width[rows].max())

        out: list[np.ndarray] = []
        for batch in plan:
            last = out[-1] if out else None
            if last is not None and size(last) < min_tokens and size(batch) < min_tokens \
                    and size(np.concatenate([last, batch])) <= 2 * min_tokens:
                out[-1] = np.concatenate([last, batch])
            else:
                out.append(batch)
        return out

    def _token_batches(self, order: np.ndarray, tokens: int, group_by_length: int, cap: int, multiple: int,
                       world_size: int, drop_last: bool, rng: np.random.Generator) -> list[np.ndarray]:
        lengths, width = self._widths(cap, multiple)  # [N] each
        if group_by_length > 1:
            window = (np.cumsum(width[order]) - 1) // (group_by_length * tokens)  # [N] window of each place
            order = order[np.lexsort((lengths[order], window))]  # stable: by window, then by length
        quantum = 8 * world_size
        plan, i, n_all = [], 0, len(order)
        while i < n_all:
            n, w = 0, 0
            while i + n < n_all and (n + 1) * max(w, width[order[i + n]]) <= tokens:
                w = max(w, width[order[i + n]])
                n += 1
            n = max(n - n % (quantum if n >= quantum else world_size), world_size)
            plan.append(order[i:i + n])
            i += n
        if drop_last and plan and len(plan[-1]) < world_size:  # a short last batch stays: its loss is a mean
            plan.pop()
        if group_by_length > 1:
            plan = [plan[j] for j in rng.permutation(len(plan))]
        return plan


def load_dataset(directory: str | Path, split: str = "train") -> TokenDataset:
    """Load one split (``train`` or ``eval``) of a directory written by ``build_dataset``."""
    d = Path(directory).expanduser()
    manifest = read_manifest(d)
    if split not in manifest.get("splits", {}):
        raise UserError(f"{d} has no '{split}' split (it has: {', '.join(manifest.get('splits', {}))})")
    _, pq = _pyarrow()
    input_ids: list[np.ndarray] = []
    loss_mask: list[np.ndarray] = []
    conv_ids: list[str] = []
    for shard in manifest["splits"][split]["shards"]:
        path = d / shard["file"]
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {path}: {e} (rebuild the data with `outrider data`)") from None
        if table.num_rows != shard["examples"]:
            raise UserError(f"{path} has {table.num_rows} rows, the manifest says {shard['examples']}: "
                            "rebuild the data")
        for column, into, dtype in (("input_ids", input_ids, np.int32), ("loss_mask", loss_mask, np.int8)):
            arr = table.column(column).combine_chunks()
            offsets = arr.offsets.to_numpy()
            values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
            into.extend(values[offsets[k]: offsets[k + 1]] for k in range(len(arr)))
        conv_ids.extend(table.column("conv_id").to_pylist())
    return TokenDataset(input_ids, loss_mask, conv_ids, manifest, split)


def merge_datasets(directories: Sequence[str | Path], out: str | Path, shard_rows: int = 8192) -> dict[str, Any]:
    """Several token datasets of one tokenizer -> one directory ``out`` (written atomically).

    Each split keeps its examples in the order given; an example whose tokens an earlier one
    already has (in either split, any directory) is dropped and counted, so that merging a dataset
    with itself, or two builds of one source, never trains on an example twice and never puts it on
    both sides of the split. Conversation ids are not compared: sources without ids number their
    records, and record 7 of one file is not record 7 of another. Datasets of another vocabulary
    or chat template are refused; pad ids may differ (the first's is kept: padding is never
    attended nor learned) and the end-of-turn ids are pooled (each dataset's loss masks are
    already final). Returns the new manifest.
    """
    dirs = [Path(d).expanduser() for d in directories]
    if len(dirs) < 2:
        raise UserError("give at least two dataset directories to merge")
    manifests = [read_manifest(d) for d in dirs]
    first = manifests[0]
    for d, m in zip(dirs[1:], manifests[1:]):
        for key in ("vocab_hash", "chat_template_hash"):  # what token ids and loss masks mean
            if m["tokenizer"].get(key) != first["tokenizer"].get(key):
                raise UserError(f"{d} was tokenised differently from {dirs[0]} ({key} differs): "
                                "build both with the same target")
    seen: set[bytes] = set()  # digests of the examples' tokens and masks
    rows: dict[str, list[tuple[str, list[int], list[int]]]] = {"train": [], "eval": []}
    duplicates = 0
    for d, m in zip(dirs, manifests):
        for split in ("train", "eval"):
            if split not in m.get("splits", {}):
                continue
            ds = load_dataset(d, split)
            for ids, mask, conv in zip(ds.input_ids, ds.loss_mask, ds.conv_ids):
                digest = hashlib.blake2b(ids.astype(np.int32).tobytes() + mask.astype(np.int8).tobytes(),
                                         digest_size=16).digest()
                if digest in seen:
                    duplicates += 1
                    continue
                seen.add(digest)
                rows[split].append((conv, ids.tolist(), mask.tolist()))
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "target": first.get("target"),
        "tokenizer": {**first["tokenizer"],  # padding is never attended nor learned: the first's pad id serves
                      "end_token_ids": sorted({int(t) for m in manifests
                                               for t in m["tokenizer"].get("end_token_ids", [])})},
        "source": {"merged": [{"directory": str(d), "target": m.get("target"), "source": m.get("source"),
                               "regenerate": m.get("regenerate"), "counts": m.get("counts")}
                              for d, m in zip(dirs, manifests)]},
        "max_length": max(int(m.get("max_length") or 0) for m in manifests),
        "regenerate": None,
        "counts": {"kept": len(rows["train"]) + len(rows["eval"]), "train": len(rows["train"]),
                   "eval": len(rows["eval"]), "dropped": {"duplicate": duplicates} if duplicates else {}},
        "columns": first["columns"],
        "splits": {},
    }
    _write_dataset(Path(out).expanduser(), manifest, rows, shard_rows)
    return manifest


def subset_dataset(directory: str | Path, out: str | Path, min_length: int, shard_rows: int = 8192
                   ) -> dict[str, Any]:
    """The examples of ``directory`` with at least ``min_length`` tokens, both splits, into ``out``
    (written atomically; a profile of long-sequence steps). Returns the new manifest."""
    d = Path(directory).expanduser()
    manifest = read_manifest(d)
    rows: dict[str, list[tuple[str, list[int], list[int]]]] = {"train": [], "eval": []}
    for split in rows:
        if split in manifest.get("splits", {}):
            ds = load_dataset(d, split)
            rows[split] = [(c, ids.tolist(), m.tolist()) for ids, m, c in zip(ds.input_ids, ds.loss_mask, ds.conv_ids)
                           if len(ids) >= min_length]
    if not rows["train"]:
        raise UserError(f"{d} has no training example of {min_length} tokens or more")
    new = {**manifest, "source": {"subset_of": str(d), "min_length": int(min_length)},
           "counts": {"kept": len(rows["train"]) + len(rows["eval"]), "train": len(rows["train"]),
                      "eval": len(rows["eval"]), "dropped": {}}, "splits": {}}
    _write_dataset(Path(out).expanduser(), new, rows, shard_rows)
    return new


# --------------------------------------------------------------------------------------------
# The pipeline


@dataclass
class DataReport:
    out: str
    source: str
    scanned: int  # source conversations looked at (after held-out exclusion)
    heldout_excluded: int
    kept: int
    train: int
    eval: int
    truncated: int
    tokens: int
    loss_tokens: int
    dropped: dict[str, int] = field(default_factory=dict)
    last_turn_only: int = 0  # conversations of which only the last turn is learned (template not prefix-stable)
    regenerated: int = 0  # conversations whose assistant turns are the target's own
    from_cache: int = 0  # of those, taken from the cache of an earlier run
    cache: str | None = None
    source_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        lines = [f"wrote {self.out}: {self.kept} conversations ({self.train} train, {self.eval} eval), "
                 f"{self.tokens} tokens, {self.loss_tokens} assistant (loss) tokens"]
        lines.append(f"source {self.source}: {self.scanned} conversations read"
                     + (f", {self.heldout_excluded} held out for benchmarks" if self.heldout_excluded else "")
                     + (f", {self.truncated} truncated" if self.truncated else "")
                     + (f", {self.last_turn_only} with only their last reply learned (the chat template renders "
                        "earlier replies differently)" if self.last_turn_only else ""))
        if self.dropped:
            lines.append("dropped: " + ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())))
        if self.regenerated or self.cache:
            lines.append(f"regenerated by the target: {self.regenerated} ({self.from_cache} from {self.cache})")
        if self.source_note:
            lines.append(self.source_note)
        return "\n".join(lines)


def _check_args(max_conversations, max_length, eval_fraction, concurrency, max_new_tokens) -> None:
    if max_conversations is not None and max_conversations < 1:
        raise UserError(f"--max-conversations must be at least 1, got {max_conversations}")
    if max_length < 8:
        raise UserError(f"--max-length must be at least 8 tokens, got {max_length}")
    if not 0.0 <= eval_fraction < 1.0:
        raise UserError(f"the eval fraction must be in [0, 1), got {eval_fraction}")
    if concurrency < 1:
        raise UserError(f"--concurrency must be at least 1, got {concurrency}")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")


def _split(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices (in source order) of train and eval examples; eval is a seeded random subset."""
    n_eval = int(round(eval_fraction * n))
    if eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    else:
        n_eval = 0
    perm = np.random.default_rng(int(seed)).permutation(n)
    eval_idx = set(int(i) for i in perm[:n_eval])
    return [i for i in range(n) if i not in eval_idx], sorted(eval_idx)


def _pad_id(tokenizer, end: set[int]) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(end, default=0))


def _regenerate(conversations: list[Conversation], tokenizer, target: str, model_path: Path, end: set[int],
                template_hash: str, out_path: Path, server: str | None, server_model: str | None,
                concurrency: int, max_new_tokens: int, max_length: int, progress: bool,
                generate_fn: GenerateFn | None, client_options: dict[str, Any],
                dropped: Counter, temperature: float = 0.0, seed: int = 0) -> tuple[list[Conversation], dict[str, Any]]:
    """Replace assistant turns with the target's replies; cached conversations are not regenerated."""
    if generate_fn is not None:
        fn_t, fn_seed = float(getattr(generate_fn, "temperature", 0.0)), getattr(generate_fn, "seed", 0)
        if fn_t != temperature or (temperature and fn_seed != seed):
            raise ValueError(f"generate_fn samples at temperature {fn_t} (seed {fn_seed}), the data was asked "
                             f"at {temperature} (seed {seed})")
    cache_file = cache_path_for(out_path)
    cache = _Cache(cache_file)
    client = None
    if server:
        from outrider.train.openai_client import ChatClient

        client = ChatClient(server, server_model, **client_options)
        backend, model_name = "server", client.check()
    else:
        backend, model_name = "local", str(model_path)
    results: dict[str, _RegenResult] = {}
    todo = []
    for conv in conversations:
        key = _regen_key(f"{backend}:{model_name}", conv, max_new_tokens, max_length, template_hash, temperature,
                         seed)
        hit = cache.get(conv.conv_id, key)
        if hit is not None:
            results[conv.conv_id] = _RegenResult(list(hit["responses"]), hit.get("stop"))
        else:
            todo.append((conv, key))
    from_cache = len(results)
    try:
        with Bar(progress, "regenerating", len(todo)) as bar:
            if todo and client is not None:
                results.update(_regen_server(todo, tokenizer, client, max_new_tokens, max_length, concurrency,
                                             cache, bar, temperature, seed))
            elif todo:
                if generate_fn is None:
                    from outrider.models import load_model

                    model, _ = load_model(target, with_tokenizer=False)
                    generate_fn = hf_generate_fn(model, _pad_id(tokenizer, end), end, temperature=temperature,
                                                 seed=seed)
                results.update(_regen_local(todo, tokenizer, generate_fn, max_new_tokens, max_length, end,
                                            cache, bar))
    finally:
        cache.close()
    out = []
    for conv in conversations:
        res = results[conv.conv_id]
        if not res.responses:
            dropped["nothing_to_learn" if res.stop in (None, "max_length") else res.stop] += 1
            continue
        out.append(Conversation(conv.conv_id, _apply_responses(conv.messages, res.responses)))
    info = {"backend": backend, "model": model_name, "server": server, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed if temperature else None, "cache": str(cache_file),
            "from_cache": from_cache, "conversations": len(out)}
    return out, info


def build_dataset(target: str, dataset: str, out: str, max_conversations: int | None = None, max_length: int = 2048,
                  eval_fraction: float = 0.05, seed: int = 0, regenerate: bool = False, server: str | None = None,
                  server_model: str | None = None, concurrency: int = 8, max_new_tokens: int = 256,
                  progress: bool = True, generate_fn: GenerateFn | None = None, temperature: float = 0.0, *,
                  shard_rows: int = 8192, retries: int = 5, backoff: float = 1.0,
                  timeout: float = 300.0) -> DataReport:
    """Conversations -> a token dataset directory ``out`` (see the module docstring)."""
    from outrider.models import load_tokenizer, resolve

    _check_args(max_conversations, max_length, eval_fraction, concurrency, max_new_tokens)
    if server and not regenerate:
        raise UserError("--server is only used to regenerate responses: add --regenerate")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise UserError(f"--temperature must be a number >= 0, got {temperature}")
    if temperature and not regenerate:
        raise UserError("--temperature is only used to regenerate responses: add --regenerate")
    out_path = Path(out).expanduser()
    tokenizer = load_tokenizer(target)
    require_chat_template(tokenizer, str(target))
    model_path = resolve(target)
    end = set(end_token_ids(tokenizer, model_path if model_path.is_dir() else None))
    fingerprint = tokenizer_fingerprint(tokenizer)

    src = _load_source(dataset, max_conversations)
    dropped: Counter = Counter(src.dropped)
    controls = _control_strings(tokenizer)
    conversations = _without_control_text(src.conversations, controls, dropped)

    regen_info: dict[str, Any] | None = None
    if regenerate and conversations:
        conversations, regen_info = _regenerate(
            conversations, tokenizer, target, model_path, end, fingerprint["chat_template_hash"], out_path,
            server, server_model, concurrency, max_new_tokens, max_length, progress, generate_fn,
            dict(timeout=timeout, retries=retries, backoff=backoff), dropped, float(temperature), seed)
        conversations = _without_control_text(conversations, controls, dropped)
        regen_info["conversations"] = len(conversations)

    rows: list[tuple[str, list[int], list[int]]] = []
    truncated = last_turn_only = 0
    seen: set[bytes] = set()
    with Bar(progress, "tokenising", len(conversations)) as bar:
        for conv in conversations:
            try:
                tok = tokenize_conversation(tokenizer, conv.messages, max_length, end)
                key = np.asarray(tok.input_ids, dtype=np.int64).tobytes()
                if key in seen:
                    raise Dropped("duplicate")
                seen.add(key)
            except Dropped as d:
                dropped[d.reason] += 1
            else:
                rows.append((conv.conv_id, tok.input_ids, tok.loss_mask))
                truncated += int(tok.truncated)
                last_turn_only += int(tok.last_turn_only)
            bar.advance()
    if not rows:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items()))
        raise UserError(f"no conversation left with anything to learn ({detail}): check the data, the chat "
                        "template or --max-length")

    train_idx, eval_idx = _split(len(rows), eval_fraction, seed)
    pad = _pad_id(tokenizer, end)
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "target": str(target),
        "tokenizer": {**fingerprint, "pad_token_id": int(pad), "end_token_ids": sorted(end)},
        "source": {"dataset": src.name, "scanned": src.scanned, "heldout_excluded": src.heldout_excluded,
                   "max_conversations": max_conversations, "note": src.note},
        "max_length": max_length, "seed": seed, "eval_fraction": eval_fraction,
        "regenerate": regen_info,
        "counts": {"kept": len(rows), "train": len(train_idx), "eval": len(eval_idx), "truncated": truncated,
                   "last_turn_only": last_turn_only, "dropped": dict(sorted(dropped.items()))},
        "columns": {"input_ids": "list<int32>", "loss_mask": "list<int8>", "conv_id": "string"},
        "splits": {},
    }
    _write_dataset(out_path, manifest, {"train": [rows[i] for i in train_idx], "eval": [rows[i] for i in eval_idx]},
                   shard_rows)
    splits = manifest["splits"]
    return DataReport(
        out=str(out_path), source=src.name, scanned=src.scanned, heldout_excluded=src.heldout_excluded,
        kept=len(rows), train=len(train_idx), eval=len(eval_idx), truncated=truncated, last_turn_only=last_turn_only,
        tokens=splits["train"]["tokens"] + splits["eval"]["tokens"],
        loss_tokens=splits["train"]["loss_tokens"] + splits["eval"]["loss_tokens"],
        dropped=dict(sorted(dropped.items())), regenerated=regen_info["conversations"] if regen_info else 0,
        from_cache=regen_info["from_cache"] if regen_info else 0, cache=regen_info["cache"] if regen_info else None,
        source_note=src.note)
