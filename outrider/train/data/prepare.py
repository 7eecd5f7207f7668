"""Conversations -> token ids + assistant loss masks, stored as Parquet shards with a manifest.

Contract:
- Reading. ShareGPT records (``conversations: [{from: human|gpt|system, value}]``) and OpenAI
  records (``messages: [{role, content}]``), from a JSON list or a JSONL file, or the embedded
  ShareGPT (``dataset='sharegpt'``, through ``outrider.sharegpt.load_sharegpt``, whose held-out
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
  seeded permutation of the examples grouped by their opening prompt (one group, one side: the
  later exchanges of a conversation, and repeated prompts, would otherwise put a train text's first
  part in eval). Output directory (written atomically): shards
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
  ``regen_budget_s`` > 0 regenerates conversations in chunks, in the source's order, while the
  budget lasts; the rest are dropped (``over_budget``).
- ``workers``: processes that tokenise (``template.tokenize_many``; 1, the default: this one; 0:
  one per CPU once there are thousands of conversations, as the CLI's `data` and `demo` ask). The rows
  are the same either way.
- ``load_dataset(dir)`` -> ``TokenDataset``: examples and deterministic shuffled, padded batches,
  shardable by rank. ``merge_datasets(dirs, out)`` joins datasets of one tokenizer (each split
  with its own; an example whose tokens were seen before is dropped).

Not done here: packing several conversations into one sequence, tool-call or multimodal turns,
top-k or top-p during regeneration, sanitising control tokens inside message text
(conversations whose text contains one of the tokenizer's special tokens are dropped instead).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from outrider.errors import UserError
from outrider.models import load_tokenizer, resolve
from outrider.progress import Bar
from outrider.train.data.conversations import load_source
from outrider.train.data.datasets import FORMAT, VERSION, opening, write_dataset
from outrider.train.data.regenerate import GenerateFn, pad_id, regenerate_conversations
from outrider.train.data.template import (
    control_strings,
    end_token_ids,
    require_chat_template,
    tokenize_many,
    vocab_identity,
    without_control_text,
)

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
    truncated_by_server: int = 0  # conversations a server's refusal cut short (kept up to the refused turn)
    server_refusal: str | None = None  # the server's first refusal, in its own words
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
        if self.server_refusal:
            lines.append(f"the server refused turns: {self.truncated_by_server} conversation(s) cut short at the "
                         f"refused turn, {self.dropped.get('server_rejected', 0)} dropped; it said: "
                         f"{self.server_refusal} (refused turns are asked again on the next run)")
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


def _split(openings: Sequence[bytes], eval_fraction: float, seed: int) -> tuple[list[int], list[int], str]:
    """Indices (in source order) of train and eval examples, and what the split kept together.

    Eval is a seeded random subset of whole groups of examples with one opening (``opening``: a
    prompt and, regenerated greedily, its reply; the later exchanges of a conversation open as its
    first does), so that no eval text is a train text's first part (a head that recalls it would
    read a higher acceptance than it drafts on new prompts). Groups are drawn in a permutation of
    their first-appearance order until ``round(eval_fraction * n)`` examples are in (at least one,
    and never all); with every group a single example this is a permutation of the examples. When
    all examples share a single opening, they are drawn one by one (``by: example``)."""
    n = len(openings)
    n_eval = min(max(int(round(eval_fraction * n)), 1), n - 1) if eval_fraction > 0 and n >= 2 else 0
    groups: dict[bytes, list[int]] = {}
    for i, key in enumerate(openings):
        groups.setdefault(key, []).append(i)
    members = list(groups.values()) if len(groups) >= 2 else [[i] for i in range(n)]
    by = "opening" if len(groups) >= 2 else "example"
    eval_idx: set[int] = set()
    for g in np.random.default_rng(int(seed)).permutation(len(members)):
        if len(eval_idx) >= n_eval:
            break
        if len(eval_idx) + len(members[g]) < n:
            eval_idx.update(members[g])
    return [i for i in range(n) if i not in eval_idx], sorted(eval_idx), by


def build_dataset(target: str, dataset: str, out: str, max_conversations: int | None = None, max_length: int = 2048,
                  eval_fraction: float = 0.05, seed: int = 0, regenerate: bool = False, server: str | None = None,
                  server_model: str | None = None, concurrency: int = 8, max_new_tokens: int = 256,
                  progress: bool = True, generate_fn: GenerateFn | None = None, temperature: float = 0.0, *,
                  shard_rows: int = 8192, retries: int = 5, backoff: float = 1.0,
                  timeout: float = 300.0, device_map: str | dict | None = None,
                  offload_folder: str | None = None, regen_budget_s: float = 0.0, workers: int = 1) -> DataReport:
    """Conversations -> a token dataset directory ``out`` (see the module docstring)."""
    _check_args(max_conversations, max_length, eval_fraction, concurrency, max_new_tokens)
    if server and not regenerate:
        raise UserError("--server is only used to regenerate responses: add --regenerate")
    if device_map is not None and (server or not regenerate):
        raise UserError("--device-map places the target for local regeneration: use it with --regenerate and "
                        "without --server")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise UserError(f"--temperature must be a number >= 0, got {temperature}")
    if temperature and not regenerate:
        raise UserError("--temperature is only used to regenerate responses: add --regenerate")
    if not (regen_budget_s >= 0 and math.isfinite(regen_budget_s)):
        raise UserError(f"the regeneration's time budget must be a number of seconds >= 0, got {regen_budget_s}")
    out_path = Path(out).expanduser()
    tokenizer = load_tokenizer(target)
    require_chat_template(tokenizer, str(target))
    model_path = resolve(target)
    end = set(end_token_ids(tokenizer, model_path if model_path.is_dir() else None))
    fingerprint = vocab_identity(tokenizer)

    src = load_source(dataset, max_conversations)
    dropped: Counter = Counter(src.dropped)
    controls = control_strings(tokenizer)
    conversations = without_control_text(src.conversations, controls, dropped)

    regen_info: dict[str, Any] | None = None
    if regenerate and conversations:
        conversations, regen_info = regenerate_conversations(
            conversations, tokenizer, target, model_path, end, fingerprint["chat_template_hash"], out_path,
            server, server_model, concurrency, max_new_tokens, max_length, progress, generate_fn,
            dict(timeout=timeout, retries=retries, backoff=backoff), dropped, float(temperature), seed,
            placement=(device_map, offload_folder), budget_s=float(regen_budget_s))
        conversations = without_control_text(conversations, controls, dropped)
        regen_info["conversations"] = len(conversations)

    rows: list[tuple[str, list[int], list[int]]] = []
    truncated = last_turn_only = 0
    seen: set[bytes] = set()
    with Bar(progress, "tokenising", len(conversations)) as bar:
        done = tokenize_many(tokenizer, [conv.messages for conv in conversations], max_length, end,
                             workers=workers, advance=bar.advance)
    for conv, tok in zip(conversations, done):
        if isinstance(tok, str):  # the reason it was dropped
            dropped[tok] += 1
            continue
        key = np.asarray(tok.input_ids, dtype=np.int64).tobytes()
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        rows.append((conv.conv_id, tok.input_ids, tok.loss_mask))
        truncated += int(tok.truncated)
        last_turn_only += int(tok.last_turn_only)
    if not rows:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items()))
        raise UserError(f"no conversation left with anything to learn ({detail}): check the data, the chat "
                        "template or --max-length")

    train_idx, eval_idx, split_by = _split([opening(ids, mask) for _, ids, mask in rows], eval_fraction, seed)
    pad = pad_id(tokenizer, end)
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "target": str(target),
        "tokenizer": {**fingerprint, "pad_token_id": int(pad), "end_token_ids": sorted(end)},
        "source": {"dataset": src.name, "scanned": src.scanned, "heldout_excluded": src.heldout_excluded,
                   "max_conversations": max_conversations, "note": src.note},
        "max_length": max_length, "seed": seed, "eval_fraction": eval_fraction, "split_by": split_by,
        "regenerate": regen_info,
        "counts": {"kept": len(rows), "train": len(train_idx), "eval": len(eval_idx), "truncated": truncated,
                   "last_turn_only": last_turn_only, "dropped": dict(sorted(dropped.items()))},
        "columns": {"input_ids": "list<int32>", "loss_mask": "list<int8>", "conv_id": "string"},
        "splits": {},
    }
    write_dataset(out_path, manifest, {"train": [rows[i] for i in train_idx], "eval": [rows[i] for i in eval_idx]},
                   shard_rows)
    splits = manifest["splits"]
    return DataReport(
        out=str(out_path), source=src.name, scanned=src.scanned, heldout_excluded=src.heldout_excluded,
        kept=len(rows), train=len(train_idx), eval=len(eval_idx), truncated=truncated, last_turn_only=last_turn_only,
        tokens=splits["train"]["tokens"] + splits["eval"]["tokens"],
        loss_tokens=splits["train"]["loss_tokens"] + splits["eval"]["loss_tokens"],
        dropped=dict(sorted(dropped.items())), regenerated=regen_info["conversations"] if regen_info else 0,
        from_cache=regen_info["from_cache"] if regen_info else 0, cache=regen_info["cache"] if regen_info else None,
        truncated_by_server=regen_info["truncated_by_server"] if regen_info else 0,
        server_refusal=regen_info["server_refusal"] if regen_info else None,
        source_note=src.note)
