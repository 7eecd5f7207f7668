"""``outrider capture``: a token dataset -> a hidden-state cache (``outrider.train.states.cache``), resumably.

Contract:
- ``capture_cache(target, data, out, dtype, ...)`` stores, for every example of both splits of
  ``data`` (train first, then eval, in index order): token ids, loss mask, the aux states at
  every position and the final normed state at the teacher rows, in shards of at most
  ``max_tokens_per_shard`` tokens (default: about 1 GiB of stored states; an example longer
  than that gets a shard of its own). The shard plan depends only on the data and that limit.
- Resumable: a cache folder that holds a header with the same settings is continued at the
  first missing shard; finished shards are never rewritten (``CacheWriter``). Other settings,
  data without loss tokens, or data of another tokenizer are refused with one line.
- Data-parallel (``ranks``, ``outrider.train.states.capture_ranks``; ``torchrun --nproc-per-node N``):
  every rank checks the inputs and builds the same header and shard plan (ranks that disagree,
  or more ranks than examples, are refused before anything is written); rank 0 alone opens the
  cache (header, a killed run's leftovers, the manifest), then the missing shards are dealt to
  the ranks by tokens, each rank captures its own (named by their index in the plan: no two
  ranks write one file) and after each one the ranks meet: rank 0 lists the others' finished
  shards in the manifest, shows the progress of all, and any rank's error stops them all. The
  shards' bytes do not depend on N (the plan does not, and a shard is captured as one process
  would), so a run resumes with any N.
- The hidden-state source is pluggable. A source is any object with
  * ``aux_layer_ids`` (tuple of ints, ascending, our convention: id ``j`` = the state entering
    decoder layer ``j`` = Hugging Face ``output_hidden_states[j]``) and ``hidden_size`` (int);
  * ``pass_tokens`` (int): how many tokens it wants per call; each call gets the next
    examples of one shard up to that many tokens (at least one example; a call never spans
    two shards, so a resumed capture writes the same bytes as one never interrupted);
  * ``states(input_ids: list[list[int]]) -> list[tuple[aux, final]]``, one pair per sequence,
    in the order given: ``aux`` [len, n_aux*H] (the aux states in ``aux_layer_ids`` order,
    concatenated), ``final`` [len, H] (the last decoder state **after** the final norm), any
    float dtype, any device (quantised where they are, then moved to the host); the sequences
    are unpadded and independent (each starts at position 0);
  * ``__enter__`` / ``__exit__``: the capture enters it once, after the plan and the resume
    check, and leaves it when done or failed.
  ``ModelSource`` (``outrider.train.states.capture``: a loaded stock model and hooks) is the default;
  a layer-streamed source plugs in through ``source=``.
- A shard is written (``CacheWriter``, one thread) while the next one is captured. A progress bar
  shows tokens/s and stored bytes per token; ``CaptureReport`` sums it up.

Not done here: the file format (``outrider.train.states.cache``), running the model
(``outrider.train.states.capture``), training from the cache (``outrider.train.states.features``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from outrider.errors import UserError
from outrider.models import (
    arch_info,
    input_device,
    load_config_dict,
    load_model,
    load_tokenizer,
    parse_device_map,
    resolve,
)
from outrider.progress import Bar, transformers_bars
from outrider.train.states import cache
from outrider.train.states.capture import ModelSource, TeacherHead
from outrider.train.states.capture_ranks import Ranks, RankStopped, assign, differ, rank_placement
from outrider.train.data.datasets import consecutive_groups, load_split, read_manifest
from outrider.train.states.target_weights import TargetWeights


@dataclass
class CaptureReport:
    out: str
    dtype: str
    shards: int
    shards_written: int  # by this run (the others were finished before)
    examples: int
    tokens: int
    bytes: int  # all shards
    bytes_per_token: float
    tokens_captured: int  # by this run
    capture_s: float
    tokens_per_s: float  # this run's
    aux_layer_ids: list[int]

    def summary(self) -> str:
        kept = self.shards - self.shards_written
        return (f"wrote {self.out}: {self.examples} examples, {self.tokens} tokens in {self.shards} shard(s)"
                + (f" ({kept} already finished)" if kept else "") + f", {self.dtype}, "
                f"{self.bytes / 1e6:,.1f} MB ({self.bytes_per_token:,.1f} B/token); aux layers {self.aux_layer_ids}; "
                f"{self.tokens_captured} tokens captured at {self.tokens_per_s:,.0f} tokens/s")


def plan_shards(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive examples packed greedily into shards of at most ``max_tokens`` tokens."""
    return consecutive_groups(lengths, max_tokens)


def default_shard_tokens(hidden_size: int, n_aux: int, dtype: str) -> int:
    """About ``cache.SHARD_BYTES`` of stored aux states."""
    item = 1 if dtype == "fp8" else cache.DTYPES[dtype].itemsize
    return max(1024, cache.SHARD_BYTES // (n_aux * hidden_size * item))


def target_identity(target: str, cfg: dict[str, Any], tokenizer: dict[str, Any]) -> dict[str, Any]:
    """What pins the target in a cache's header (files only; no model is built)."""
    info = arch_info(cfg)
    keep = {k: v for k, v in cfg.items() if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype",
                                                       "use_cache", "architectures")}
    try:  # a GGUF file or weights in another container: the cache then names no weights
        weights = None if resolve(target).is_file() else TargetWeights(target).fingerprint()
    except UserError:
        weights = None
    return {"name": str(target), "model_type": info.model_type, "hidden_size": info.hidden_size,
            "num_layers": info.num_layers, "vocab_size": info.vocab_size,
            "config_sha256": hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest(),
            "weights_sha256": weights, "tokenizer": tokenizer}


def capture_cache(target: str, data: str, out: str, dtype: str = "bf16", aux_layer_ids: Sequence[int] | None = None,
                  max_tokens_per_shard: int | None = None, device: str | torch.device | None = None,
                  model_dtype: str | torch.dtype | None = None, block: int | None = None,
                  batch_tokens: int | None = None, progress: bool = True, source: Any = None,
                  device_map: str | dict | None = None, offload_folder: str | None = None,
                  teacher_topk: int = 0, ranks: Ranks | None = None) -> CaptureReport:
    """Capture ``data`` (a token dataset folder) through ``target`` into the cache folder ``out``.

    dtype:       stored values: ``bf16``, ``fp8`` (float8_e4m3fn with float32 scales) or ``float32``
    block:       values per fp8 scale (default: the hidden size, one scale per token row and state)
    device, model_dtype, batch_tokens: for the default source (a loaded target; ``batch_tokens`` padded
                 tokens per forward: 32768 on CUDA, 4096 elsewhere)
    source:      a hidden-state source (see the module docstring) instead of loading the target
    device_map, offload_folder: place the loaded target through accelerate (``outrider.models.load_model``)
    teacher_topk: K > 0 stores, at the teacher rows, the target's K largest logits (and their logsumexp)
                 instead of the final state (``cache.encode``); 0 stores the final state
    ranks:       this process's place in a data-parallel capture (``capture_ranks.Ranks``); None: alone
    """
    ranks = ranks or Ranks()
    prep, error = None, None
    try:
        prep = _prepare(target, data, dtype, aux_layer_ids, max_tokens_per_shard, block, teacher_topk, ranks.world)
    except UserError as e:
        error = e
    replies = ranks.settle(error, header=prep.header if prep else None)
    disagree = differ(replies, "header")
    if disagree:
        r, fields = next(iter(disagree.items()))
        raise (UserError if ranks.lead else RankStopped)(
            f"rank {r} of {ranks.world} was started with another command than rank 0 ({', '.join(fields)} differ): "
            "start every rank with the same command")
    header, plan, lengths = prep.header, prep.plan, prep.lengths
    writer, error, todo = None, None, []
    if ranks.lead:  # the header, a killed run's temporaries and orphan shards: before any other rank writes
        try:
            writer = cache.CacheWriter(out, header)
            todo = [k for k in range(len(plan)) if k not in writer.shards]
        except UserError as e:
            error = e
    replies = ranks.settle(error, todo=todo, bytes=sum(e["bytes"] for e in writer.shards.values()) if writer else 0)
    todo, stored = replies[0]["todo"], replies[0]["bytes"]
    writer = writer or cache.CacheWriter(out, header, lead=False)
    shard_tokens = {k: sum(lengths[i] for i in plan[k]) for k in todo}
    deal = assign(shard_tokens, ranks.world)
    mine, rounds = deal[ranks.rank], max(len(d) for d in deal)
    H, ids, teacher_topk = prep.hidden, prep.aux_layer_ids, prep.teacher_topk
    error = None
    if mine:
        try:
            if source is None:
                source = _model_source(target, ids, device, model_dtype, batch_tokens, progress and ranks.lead,
                                       device_map, offload_folder, ranks)
            if tuple(source.aux_layer_ids) != tuple(ids) or int(source.hidden_size) != H:
                raise ValueError(f"the source gives aux ids {source.aux_layer_ids} of width {source.hidden_size}, "
                                 f"the capture wants {ids} of {H}")
        except Exception as e:  # told to the other ranks, then raised
            error = e
    ranks.settle(error)
    total = sum(lengths)
    done_tokens = total - sum(shard_tokens.values())
    teacher = _FullTeacher(target) if teacher_topk and mine else None
    t0, captured, everyone = time.perf_counter(), 0, 0
    kept = "; the finished shards are kept: rerun the same command, with any number of ranks, to go on"
    # shard k+1 is captured while shard k is written (one writer thread, at most one shard waiting); the
    # ranks meet after each of their shards (``rounds``) and once more when the last writes have finished
    fields = "{tps} tok/s {bpt} B/token"
    with (source if mine else contextlib.nullcontext()), \
            Bar(progress and ranks.lead, "capture", total, completed=done_tokens, fields=fields) as bar, \
            ThreadPoolExecutor(max_workers=1) as pool:
        pending, new_bytes, new_tokens = None, 0, 0
        for j in range(rounds + 1):
            finished, error = [], None
            try:
                if j < len(mine):
                    rows = [prep.examples[i] for i in plan[mine[j]]]
                    shard = _capture_shard(rows, prep.splits, source, dtype, prep.block, len(ids), H, teacher,
                                           teacher_topk)
                    captured += sum(len(e.input_ids) for e in shard)
                if pending is not None:
                    finished.append(pending.result())
                    pending = None
                if j < len(mine):
                    pending = pool.submit(writer.write_shard, mine[j], shard)
            except Exception as e:  # told to the other ranks, then raised
                error = e
            replies = ranks.settle(error, suffix=kept, entries=finished, tokens=captured)
            entries = [e for p in replies for e in p["entries"]]
            if ranks.lead and ranks.distributed:
                writer.add([e for p in replies[1:] for e in p["entries"]])
            new_bytes, new_tokens = new_bytes + sum(e["bytes"] for e in entries), new_tokens + sum(
                e["tokens"] for e in entries)
            everyone = sum(p["tokens"] for p in replies)
            bar.update(done_tokens + everyone, tps=f"{everyone / (time.perf_counter() - t0):,.0f}",
                       bpt=f"{new_bytes / new_tokens:,.0f}" if new_tokens else "-")
    elapsed = time.perf_counter() - t0
    stored += new_bytes
    return CaptureReport(out=str(writer.out), dtype=dtype, shards=len(plan), shards_written=len(todo),
                         examples=len(prep.examples), tokens=total, bytes=stored,
                         bytes_per_token=stored / max(total, 1), tokens_captured=everyone, capture_s=elapsed,
                         tokens_per_s=everyone / elapsed if elapsed > 0 else 0.0, aux_layer_ids=list(ids))


@dataclass
class _Prepared:
    header: dict[str, Any]
    plan: list[list[int]]  # shard -> indices into ``examples``
    examples: list[tuple[str, int]]  # (split, index): train first, then eval
    lengths: list[int]
    splits: dict[str, Any]
    aux_layer_ids: list[int]
    hidden: int
    block: int
    teacher_topk: int


def _prepare(target: str, data: str, dtype: str, aux_layer_ids: Sequence[int] | None, max_tokens_per_shard: int | None,
             block: int | None, teacher_topk: int, world: int) -> _Prepared:
    """The checks of the inputs, the shard plan (the same for any number of ranks) and the header."""
    if dtype not in cache.DTYPES:
        raise UserError(f"unknown cache dtype '{dtype}': use one of {', '.join(cache.DTYPES)}")
    cfg = load_config_dict(target)
    info = arch_info(cfg)
    ids = sorted(int(j) for j in (aux_layer_ids if aux_layer_ids is not None else info.default_aux_layer_ids()))
    if len(set(ids)) != 3 or not all(0 <= j < info.num_layers for j in ids):
        raise UserError(f"aux layer ids {ids} must be three distinct ids in 0..{info.num_layers - 1}: pass them with "
                        "--aux-layers")
    H = info.hidden_size
    block = H if block is None else int(block)
    if dtype == "fp8" and (block < 1 or H % block):
        raise UserError(f"the fp8 block {block} must divide the hidden size {H}")
    if not 0 <= int(teacher_topk) <= info.vocab_size:
        raise UserError(f"--teacher-topk must be in 0..{info.vocab_size} (the target's vocabulary), got {teacher_topk}")
    teacher_topk = int(teacher_topk)
    manifest = read_manifest(data)
    splits = {s: load_split(data, s, required=(s == "train")) for s in ("train", "eval")}
    splits = {s: ds for s, ds in splits.items() if ds is not None}
    if sum(ds.num_loss_tokens for ds in splits.values()) == 0:
        raise UserError(f"the data {data} has no loss tokens (assistant tokens): nothing to train on; rebuild it with "
                        "`outrider data` from conversations with assistant turns")
    splits["train"].check_tokenizer(load_tokenizer(target))
    examples = [(s, i) for s, ds in splits.items() for i in range(len(ds))]
    if world > len(examples):
        raise UserError(f"{world} ranks for {len(examples)} examples: start at most {len(examples)} "
                        "(torchrun --nproc-per-node)")
    lengths = [len(splits[s].input_ids[i]) for s, i in examples]
    limit = int(max_tokens_per_shard or default_shard_tokens(H, len(ids), dtype))
    if limit < 1:
        raise UserError(f"--max-tokens-per-shard must be positive, got {limit}")
    plan = plan_shards(lengths, limit)
    data_sha = hashlib.sha256((Path(data).expanduser() / "manifest.json").read_bytes()).hexdigest()
    header = {
        "format": cache.FORMAT, "version": cache.VERSION,
        "target": target_identity(target, cfg, manifest["tokenizer"]),
        "aux_layer_ids": ids, "aux_semantics": cache.AUX_SEMANTICS, "final": cache.FINAL_SEMANTICS,
        "teacher": ({"kind": "topk", "k": teacher_topk, "rule": cache.TOPK_SEMANTICS} if teacher_topk
                    else {"kind": "final"}),
        "dtype": dtype,
        "scaling": ({"scheme": "float8_e4m3fn", "block": block, "scale_dtype": "float32",
                     "rule": "x = q * scale, scale = max|x| / 448 over each block of values"}
                    if dtype == "fp8" else None),
        "data": {"path": str(Path(data).expanduser().resolve()), "manifest_sha256": data_sha,
                 "splits": {s: {"examples": len(ds), "tokens": ds.num_tokens, "loss_tokens": ds.num_loss_tokens}
                            for s, ds in splits.items()}},
        "max_tokens_per_shard": limit, "shards": len(plan),
    }
    return _Prepared(header, plan, examples, lengths, splits, ids, H, block, teacher_topk)


def _model_source(target: str, ids: Sequence[int], device: Any, model_dtype: Any, batch_tokens: int | None,
                  progress: bool, device_map: Any = None, offload_folder: str | None = None,
                  ranks: Ranks | None = None):
    max_memory = None
    if ranks is not None and ranks.distributed and device_map is not None:  # each rank on GPUs of its own
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device_map, max_memory = rank_placement(parse_device_map(device_map), ranks.local_rank, ranks.local_world,
                                                gpus)
        if offload_folder is not None:  # each rank offloads its own copy
            offload_folder = str(Path(offload_folder) / f"rank-{ranks.rank}")

    with transformers_bars(progress):  # --quiet: not even transformers' bar while the weights load
        model, _ = load_model(target, device=device, dtype=model_dtype, with_tokenizer=False, device_map=device_map,
                              offload_folder=offload_folder, max_memory=max_memory)
    cuda = input_device(model).type == "cuda"
    return ModelSource(model, ids, batch_tokens or (32768 if cuda else 4096))


class _FullTeacher:
    """The target's whole ``lm_head`` (bias and soft-capping included) for top-k teachers, read once
    from its safetensors and copied to each device the states arrive on."""

    def __init__(self, target: str):
        weights = TargetWeights(target)
        vocab = int(arch_info(weights.config).vocab_size)
        everything = torch.arange(vocab)
        self.head = TeacherHead(weights.lm_head_rows(everything), weights.lm_head_bias(everything),
                                weights.config.get("final_logit_softcapping"))
        self._on: dict[torch.device, TeacherHead] = {}

    def on(self, device: torch.device) -> TeacherHead:
        if device not in self._on:
            h = self.head
            self._on[device] = TeacherHead(h.weight.to(device), None if h.bias is None else h.bias.to(device),
                                           h.softcap)
        return self._on[device]


def _capture_shard(rows: list[tuple[str, int]], splits: dict[str, Any], source: Any, dtype: str, block: int,
                   n_aux: int, hidden: int, teacher: _FullTeacher | None = None, topk: int = 0
                   ) -> list[cache.Example]:
    """A shard's examples run through the source, pass by pass, and encoded for storage (on the host)."""
    out: list[cache.Example] = []
    start = 0
    while start < len(rows):
        end, size = start, 0
        while end < len(rows) and (end == start or size + len(splits[rows[end][0]].input_ids[rows[end][1]])
                                   <= source.pass_tokens):
            size += len(splits[rows[end][0]].input_ids[rows[end][1]])
            end += 1
        part = rows[start:end]
        seqs = [splits[s].input_ids[i].astype(np.int64).tolist() for s, i in part]
        states = source.states(seqs)
        if len(states) != len(seqs):
            raise ValueError(f"the source returned {len(states)} results for {len(seqs)} sequences")
        for (s, i), seq, (aux, final) in zip(part, seqs, states):
            if aux.shape != (len(seq), n_aux * hidden) or final.shape[0] != len(seq):
                raise ValueError(f"the source's states of a {len(seq)}-token sequence have shapes "
                                 f"{tuple(aux.shape)} and {tuple(final.shape)}")
            head = teacher.on(final.device) if teacher is not None else None
            stored = cache.encode(aux, final, splits[s].loss_mask[i], n_aux, dtype, block, head, topk).host()
            out.append(cache.Example(s, i, splits[s].conv_ids[i], splits[s].input_ids[i], splits[s].loss_mask[i],
                                     stored))
        start = end
    return out
