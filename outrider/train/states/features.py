"""What the trainer reads of the target: a loaded model (online) or a hidden-state cache.

Contract: two of the trainer's target sides (``side.TargetSide``), opened by ``open_target``:
``OnlineTarget`` (features from the target's forward, per batch) and ``CachedTarget``.
``CachedTarget`` never builds the target: it reads the embedding, the lm_head rows of the draft
vocabulary and (for states stored before it) the final norm lazily from the target's
safetensors (``TargetWeights``). Its cache is ours (``outrider.train.states.cache``) or a peer's
(``outrider.train.states.peers``: SpecForge, speculators/vLLM, hs-connectors fp8); the format is
detected from the files. Its examples are addressed by ``Batch.indices``: a split's datasets
number them ``train`` first, then ``eval``. A cache of another target (config, weights or
tokenizer), of other aux ids, or without loss tokens is refused with one line. Without
``--aux-layers``, a peer's cache is taken to hold the peers' default layers, ``(2, L//2, L-3)`` in
our convention (SpecForge's ``[1, L//2-1, L-4]``), which the notes say.

Teacher rows a cache does not hold are left zero: the TTT loss reads only the teacher rows of
positions whose next token is learned, and those are stored.

Not done here: the loss and the loop (``outrider.train.loop``), writing caches (``cache_capture``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from outrider import models
from outrider.errors import UserError
from outrider.models import (
    arch_info,
    is_dispatched,
    load_tokenizer,
    parse_dtype,
    resident_weight,
)
from outrider.train.data.datasets import Batch, BatchCursor, TokenDataset, load_split, split_note, to_device
from outrider.train.loop import flops
from outrider.train.states import peers
from outrider.train.states.cache import OutriderCache, dequantize, topk_teacher
from outrider.train.states.cache_capture import target_identity
from outrider.train.states.capture import Captured, TargetCapture, TeacherHead
from outrider.train.states.side import TargetSide
from outrider.train.states.target_weights import TargetWeights


def open_target(target: str, data: str | None, cache: str | None, device: torch.device, dtype: Any, loaded: Any,
                aux_layer_ids: Sequence[int] | None,
                placement: tuple[Any, Any] = (None, None)) -> TargetSide:
    """The target side of a run: ``cache`` read with the target's few tensors, or the target loaded
    (``loaded``: a model or ``(model, tokenizer)`` already in memory; ``placement``: accelerate's
    ``(device_map, offload_folder)``) after its ``data`` (a bad directory fails fast)."""
    if cache is not None:
        if placement[0] is not None:
            raise UserError("--cache trains with no forward of the target: drop --device-map")
        return CachedTarget(cache, target, device, parse_dtype(dtype, device), aux_layer_ids)
    splits = {"train": load_split(data, "train", required=True), "eval": load_split(data, "eval", required=False)}
    if loaded is None:
        model, tokenizer = models.load_model(target, device=device, dtype=dtype, device_map=placement[0],
                                             offload_folder=placement[1])
    else:
        model, tokenizer = loaded if isinstance(loaded, tuple) else (loaded, None)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target)
        model = model.to(device)
    splits["train"].check_tokenizer(tokenizer)
    side = OnlineTarget(model.eval().requires_grad_(False), splits, device)
    side.notes.extend(filter(None, [split_note(splits["eval"])]))
    return side


class OnDevice(torch.nn.Module):
    """A frozen module of a target placed by accelerate whose outputs must land on ``device``."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        super().__init__()
        self.inner, self.device = (module,), device  # a tuple: not registered, never trained or saved

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner[0](input_ids).to(self.device)


class OnlineTarget:
    """The target in memory (on ``device``, or placed by accelerate): features from its forward, per batch."""

    aux_layer_ids = None  # any: the hooks capture what the run asks for

    def __init__(self, model: torch.nn.Module, splits: dict[str, TokenDataset | None],
                 device: torch.device | None = None):
        self.model = model
        self.config = model.config
        self.device = device
        self.embedding = model.get_input_embeddings()
        if is_dispatched(model) and device is not None:  # embeddings come back to the head's device
            self.embedding = OnDevice(self.embedding, device)
        self.splits = splits
        self.notes: list[str] = []

    def lm_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        lm_head = self.model.get_output_embeddings()
        if lm_head is None:
            return None
        weight = resident_weight(lm_head)  # offloaded by accelerate: its CPU copy
        return weight.detach().index_select(0, ids.to(weight.device))

    def norm_weight(self) -> torch.Tensor | None:
        norm = getattr(self.model.get_decoder(), "norm", None)
        return None if getattr(norm, "weight", None) is None else resident_weight(norm)

    def last_layer(self) -> torch.nn.Module:
        return self.model.get_decoder().layers[-1]

    def flops_per_token(self, extra: int) -> float:
        return flops.target_flops_per_token(self.model.get_decoder(), self.model.get_input_embeddings().parameters(),
                                            extra, self.model.config)

    def attention_flops(self, pairs: int) -> float:
        return flops.target_attention_flops(self.model.config, pairs)

    def follow(self, cursor: BatchCursor) -> BatchCursor:
        return cursor

    def feature_source(self, aux_layer_ids: Sequence[int], vocab: Any, cfg: Any) -> TargetCapture:
        return TargetCapture(self.model, aux_layer_ids, vocab.draft_ids, graphs=cfg.graph_target,
                             max_tokens=cfg.max_batch_tokens, device=self.device)


class CacheSplit(TokenDataset):
    """A split of a cache's examples; its batches' ``indices`` are numbered across splits (+ ``offset``)."""

    def __init__(self, input_ids: list[np.ndarray], loss_mask: list[np.ndarray], ids: list[str],
                 tokenizer: dict[str, Any] | None, split: str, offset: int):
        super().__init__(input_ids, loss_mask, ids, {"tokenizer": tokenizer or {}}, split)
        self.offset = offset

    def collate(self, indices: Sequence[int], pad_to_multiple_of: int = 1) -> Batch:
        batch = super().collate(indices, pad_to_multiple_of)
        return Batch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.indices + self.offset)


def open_cache(path: str | Path) -> Any:
    """Our cache, or a peer's (format detected from the files); a one-line refusal otherwise."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"cache not found: {p} (give the --out of `outrider capture`, or a SpecForge or speculators "
                        "hidden-state folder)")
    if (p / "header.json").exists():
        return OutriderCache(p)
    return peers.open_peer(p)


class CachedTarget:
    """A hidden-state cache plus the target's embedding, lm_head rows and final norm, read lazily."""

    def __init__(self, cache_path: str, target: str, device: torch.device, dtype: torch.dtype,
                 aux_layer_ids: Sequence[int] | None):
        self.reader = open_cache(cache_path)
        self.weights = TargetWeights(target)
        self.config = self.weights.config
        self.device, self.dtype = device, dtype
        self.notes: list[str] = []
        info = arch_info(self.config)
        if self.reader.hidden_size != info.hidden_size:
            raise UserError(f"the cache {cache_path} holds states of width {self.reader.hidden_size}, the target "
                            f"{target} has hidden size {info.hidden_size}: it was captured from another model")
        self._check_target(target, info)
        self.aux_layer_ids = self._aux_ids(aux_layer_ids, info)
        self.splits: dict[str, TokenDataset | None] = {"train": None, "eval": None}
        self.index: list[tuple[str, int]] = []
        for split in self.reader.splits():
            ids, mask, names = self.reader.examples(split)
            self.splits[split] = CacheSplit(ids, mask, names, self.reader.tokenizer, split, len(self.index))
            self.index += [(split, i) for i in range(len(ids))]
        train = self.splits["train"]
        if train is None or train.num_loss_tokens == 0:
            raise UserError(f"the cache {cache_path} holds no loss tokens in its training examples: nothing to train "
                            "on (capture data with assistant turns)")
        if self.reader.tokenizer and self.reader.tokenizer.get("vocab_hash"):
            train.check_tokenizer(load_tokenizer(target))
        self.embedding = torch.nn.Embedding.from_pretrained(self.weights.embedding().to(device, dtype), freeze=True)

    def _check_target(self, target: str, info: Any) -> None:
        pinned = getattr(self.reader, "header", {}).get("target")
        if not pinned:
            return
        have = target_identity(target, self.config, pinned.get("tokenizer"))
        for key, what in (("config_sha256", "config"), ("weights_sha256", "weights")):
            if pinned.get(key) and have.get(key) and pinned[key] != have[key]:
                raise UserError(f"the cache {self.reader.path} was captured from another target ({what} differ from "
                                f"{target}'s): train with the target it was captured from, or capture it again")

    def _aux_ids(self, asked: Sequence[int] | None, info: Any) -> tuple[int, ...]:
        have = self.reader.aux_layer_ids
        if have is None:  # a peer's cache records no layer ids
            ids = tuple(sorted(asked)) if asked is not None else info.default_aux_layer_ids()
            if asked is None:
                self.notes.append(f"the {self.reader.kind} cache records no layer ids: taken to be the default "
                                  f"{list(ids)} (state entering layer j); pass --aux-layers if it holds others")
            return ids
        if asked is not None and tuple(sorted(asked)) != tuple(have):
            raise UserError(f"the cache {self.reader.path} holds aux layers {list(have)}, not {sorted(asked)}: drop "
                            "--aux-layers, or capture again with these ids")
        return tuple(have)

    def lm_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.lm_head_rows(ids)

    def norm_weight(self) -> torch.Tensor:
        return self.weights.norm_weight()

    def last_layer(self) -> None:
        return None  # a cache carries no decoder layer

    def flops_per_token(self, extra: int) -> float:
        # the teacher's projection only (none when the cache stores top-k logits): no forward of the target
        return 0.0 if getattr(self.reader, "topk", 0) else 2.0 * extra

    def attention_flops(self, pairs: int) -> float:
        return 0.0

    def follow(self, cursor: BatchCursor) -> BatchCursor:
        return cursor

    def feature_source(self, aux_layer_ids: Sequence[int], vocab: Any, cfg: Any) -> "CachedFeatures":
        ids = vocab.draft_ids
        if getattr(self.reader, "topk", 0):  # the teacher comes stored: no lm_head rows needed
            vocab_size = int(arch_info(self.config).vocab_size)
            draft_index = torch.full((vocab_size,), -1, dtype=torch.long)
            draft_index[ids] = torch.arange(len(ids))
            return CachedFeatures(self.reader, self.index, None, None, self.device, self.dtype,
                                  topk=(draft_index.to(self.device), vocab_size))
        bias = self.weights.lm_head_bias(ids)
        teacher = TeacherHead(self.weights.lm_head_rows(ids).to(self.device, self.dtype),
                              None if bias is None else bias.to(self.device, self.dtype),
                              self.config.get("final_logit_softcapping"))
        norm = self.weights.final_norm(self.dtype, self.device) if self.reader.final_prenorm else None
        return CachedFeatures(self.reader, self.index, teacher, norm, self.device, self.dtype)


class CachedFeatures(contextlib.AbstractContextManager):
    """A training batch's aux states and teacher, read from a cache (host) and finished on the device."""

    def __init__(self, reader: Any, index: list[tuple[str, int]], teacher: TeacherHead | None,
                 norm: torch.nn.Module | None, device: torch.device, dtype: torch.dtype,
                 topk: tuple[torch.Tensor, int] | None = None):
        # topk: (draft index [vocab] of each target id or -1, vocab size) for a cache of top-k teachers
        self.reader, self.index, self.teacher, self.norm = reader, index, teacher, norm
        self.device, self.dtype, self.topk = device, dtype, topk
        self.notes: list[str] = []

    @torch.no_grad()
    def features(self, batch: Batch) -> Captured:
        B, S = batch.input_ids.shape
        stored = [self.reader.read(*self.index[int(g)]) for g in batch.indices.tolist()]  # host
        first = stored[0]
        n, H = first.aux.shape[1:]
        raw = first.aux.dtype == torch.float8_e4m3fn
        pin = self.device.type == "cuda"  # filled in place in page-locked memory, copied behind the device's work
        aux = torch.zeros(B, S, n, H, dtype=torch.uint8 if raw else first.aux.dtype, pin_memory=pin)  # as stored
        scale = None if first.aux_scale is None else torch.zeros(B, S, n, first.aux_scale.shape[-1], pin_memory=pin)
        finals, fscales, flat, tops = [], [], [], []
        for b, st in enumerate(stored):
            L = min(st.aux.shape[0], S)
            aux[b, :L] = st.aux[:L].view(torch.uint8) if raw else st.aux[:L]
            if scale is not None:
                scale[b, :L] = st.aux_scale[:L]
            keep = st.rows < S
            if self.topk is not None:
                tops.append((st.teacher_ids[keep], st.teacher_logits[keep], st.teacher_lse[keep]))
            else:
                finals.append(st.final[keep].view(torch.uint8) if raw else st.final[keep])
            if st.final_scale is not None:
                fscales.append(st.final_scale[keep])
            flat.append(b * S + st.rows[keep])
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else to_device(t, self.device, True)

        aux_d, scale_d, flat_d = move(aux), move(scale), move(torch.cat(flat))
        if raw:
            aux_d = aux_d.view(torch.float8_e4m3fn)
        aux_out = dequantize(aux_d, scale_d, self.dtype).reshape(B, S, n * H)  # [B, S, n_aux*H]
        if self.topk is not None:  # [M, draft_vocab] from the stored top-k logits
            draft_index, vocab_size = self.topk
            ids, values, lse = (move(torch.cat(parts)) for parts in zip(*tops))
            rows = topk_teacher(ids, values, lse, draft_index, vocab_size, self.dtype)
        else:
            final_d = move(torch.cat(finals))
            fscale_d = move(torch.cat(fscales)) if fscales else None
            if raw:
                final_d = final_d.view(torch.float8_e4m3fn)
            final = dequantize(final_d, fscale_d, self.dtype)  # [M, H]
            if self.norm is not None:
                final = self.norm(final)
            rows = self.teacher(final)  # [M, draft_vocab]
        teacher = torch.zeros(B * S, rows.shape[-1], dtype=self.dtype, device=self.device)
        teacher.index_copy_(0, flat_d, rows)
        return Captured(aux=aux_out, teacher=teacher.view(B, S, -1))

    def __exit__(self, *exc) -> None:
        return None
