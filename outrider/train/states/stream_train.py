"""Streamed online training: the target streamed layer by layer, one pass of upcoming examples at a time.

Contract:
- ``StreamedOnline(target, data, device, dtype, aux_layer_ids, options)`` is a target side of the
  trainer (``outrider.train.states.side.TargetSide``) for a target that is never loaded whole:
  ``outrider.train.states.stream.StreamedTarget`` sized by ``options``
  (``outrider.train.options.StreamOptions``). Its embedding,
  lm_head rows and final norm are read from the safetensors (``TargetWeights``); its splits
  number examples train first, then eval, as a cache's do.
- ``follow(cursor)`` wraps the trainer's ``BatchCursor`` in a ``PassCursor``, which notes the
  epoch and number of every batch it hands out (its ``state()`` is the cursor's).
- ``feature_source`` gives ``StreamedFeatures``. Passes are fixed by the epoch's batch plan alone:
  its batches, in order, cut greedily into runs of at most ``tokens_per_pass`` tokens (a batch
  is never split). A training batch outside the current pass makes it capture the pass that holds
  it, all of it, with one ``states`` call (one stream of the weights), so a resumed run captures
  the very passes an uninterrupted one did and continues bit for bit. An eval batch makes it
  capture every example the evaluation reads, once for the run (the target is frozen). A pass's
  states are kept as a cache keeps them (``outrider.train.states.cache.encode``, in the streamer's dtype:
  lossless) and turned into batches by the cache's own code (``CachedFeatures``), so training
  equals training from a cache holding the same states; with chunks of one example
  (``max_chunk_tokens=1``) the states do not depend on which examples share a pass, and it equals
  training from ``outrider capture --stream-layers``'s cache of the same data.

Not done here: several processes (each would stream the whole model), overlapping a pass's capture
with training on the previous one, the loss and the loop (``outrider.train.loop``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from outrider.errors import UserError
from outrider.models import load_tokenizer
from outrider.train.data.datasets import Batch, BatchCursor, consecutive_groups, load_split
from outrider.train.loop import flops
from outrider.train.options import StreamOptions
from outrider.train.states import cache
from outrider.train.states.capture import TeacherHead
from outrider.train.states.features import CachedFeatures, CacheSplit
from outrider.train.states.stream import StreamedTarget
from outrider.train.states.target_weights import TargetWeights


class PassCursor:
    """A ``BatchCursor`` that remembers the epoch and number of the batches it hands out."""

    def __init__(self, cursor: BatchCursor):
        self.cursor = cursor
        self.numbers: dict[tuple[int, ...], tuple[int, int]] = {}  # batch indices -> (epoch, number)

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    @property
    def pad(self) -> int:
        return self.cursor.pad

    def next(self) -> Batch:
        batch = self.cursor.next()
        self.numbers[tuple(batch.indices.tolist())] = (self.cursor.epoch, self.cursor.batch - 1)
        return batch

    def state(self) -> dict[str, int]:
        return self.cursor.state()

    def passes(self, epoch: int, tokens: int, lengths: np.ndarray) -> list[list[int]]:
        """The epoch's batches (numbers) cut greedily into passes of at most ``tokens`` tokens."""
        return consecutive_groups([int(lengths[rows].sum()) for rows in self.cursor.epoch_plan(epoch)], tokens)


class _PassStore:
    """Stored states of the current pass (and of the eval examples), read as a cache is."""

    def __init__(self, streamer: StreamedTarget, splits: dict[str, Any], dtype: str):
        self.streamer, self.splits, self.dtype = streamer, splits, dtype
        self.offsets = {"train": 0, "eval": len(splits["train"])}
        self.current: dict[int, cache.Stored] = {}
        self.evals: dict[int, cache.Stored] = {}
        self.passes = 0

    def where(self, g: int) -> tuple[str, int]:
        return ("eval", g - self.offsets["eval"]) if g >= self.offsets["eval"] else ("train", g)

    def read(self, split: str, i: int) -> cache.Stored:
        g = self.offsets[split] + i
        return self.evals[g] if split == "eval" else self.current[g]

    def capture(self, indices: Sequence[int], into: dict[int, cache.Stored]) -> None:
        """Stream the examples ``indices`` (global numbers) once, in this order."""
        rows = [self.where(g) for g in indices]
        seqs = [self.splits[s].input_ids[i].astype(np.int64).tolist() for s, i in rows]
        n_aux = len(self.streamer.aux_layer_ids)
        for g, (s, i), (aux, final) in zip(indices, rows, self.streamer.states(seqs)):
            into[g] = cache.encode(aux, final, self.splits[s].loss_mask[i], n_aux, self.dtype,
                                   self.streamer.hidden_size)
        self.passes += 1


class StreamedFeatures(CachedFeatures):
    """Training batches from passes captured by streaming (see the module docstring)."""

    def __init__(self, store: _PassStore, cursor: PassCursor | None, eval_count: int, index: list,
                 teacher: TeacherHead, device: torch.device, dtype: torch.dtype):
        super().__init__(store, index, teacher, None, device, dtype)
        self.store, self.cursor, self.eval_count = store, cursor, eval_count
        self.lengths = self.store.splits["train"].lengths
        self._passes: tuple[int, list[list[int]]] | None = None  # (epoch, its passes)

    @torch.no_grad()
    def features(self, batch: Batch) -> Any:
        wanted = [int(g) for g in batch.indices.tolist()]
        if wanted and wanted[0] >= self.store.offsets["eval"]:
            if not all(g in self.store.evals for g in wanted):
                first = self.store.offsets["eval"]
                todo = [g for g in range(first, first + self.eval_count) if g not in self.store.evals]
                todo += [g for g in wanted if g not in self.store.evals and g not in todo]
                self.store.capture(todo, self.store.evals)
            return super().features(batch)
        where = None if self.cursor is None else self.cursor.numbers.pop(tuple(wanted), None)
        if not all(g in self.store.current for g in wanted):
            self.store.current = {}
            self.store.capture(self._pass_of(wanted, where), self.store.current)
        return super().features(batch)

    def _pass_of(self, wanted: list[int], where: tuple[int, int] | None) -> list[int]:
        """The examples of the pass that holds this batch (only the batch, for one the cursor did not give)."""
        if where is None:
            return wanted
        epoch, number = where
        if self._passes is None or self._passes[0] != epoch:
            self._passes = (epoch, self.cursor.passes(epoch, self.store.streamer.pass_tokens, self.lengths))
        plan = self.cursor.cursor.epoch_plan(epoch)
        batches = next(p for p in self._passes[1] if number in p)
        return [int(g) for b in batches for g in plan[b]]

    def __exit__(self, *exc) -> None:
        self.store.streamer.close()
        return None


class StreamedOnline:
    """The trainer's target side for a target streamed layer by layer (see the module docstring)."""

    def __init__(self, target: str, data: str, device: torch.device, dtype: torch.dtype,
                 aux_layer_ids: Sequence[int] | None, options: StreamOptions):
        self.device, self.dtype = device, dtype
        train = load_split(data, "train", required=True)
        evals = load_split(data, "eval", required=False)
        tokenizer = train.manifest.get("tokenizer")
        self.splits: dict[str, Any] = {"train": CacheSplit(train.input_ids, train.loss_mask, train.conv_ids,
                                                           tokenizer, "train", 0), "eval": None}
        if evals is not None:
            self.splits["eval"] = CacheSplit(evals.input_ids, evals.loss_mask, evals.conv_ids, tokenizer, "eval",
                                             len(train))

        self.splits["train"].check_tokenizer(load_tokenizer(target))
        self.weights = TargetWeights(target)
        self.config = self.weights.config
        self.streamer = StreamedTarget(target, sorted(aux_layer_ids) if aux_layer_ids is not None else None,
                                       device=device, dtype=dtype, **options.as_kwargs())
        self.aux_layer_ids = self.streamer.aux_layer_ids
        self.embedding = torch.nn.Embedding.from_pretrained(self.weights.embedding().to(device, dtype), freeze=True)
        self.index = [("train", i) for i in range(len(train))] + [("eval", i) for i in range(len(evals or []))]
        self.cursor: PassCursor | None = None
        self.notes: list[str] = []

    def follow(self, cursor: BatchCursor) -> PassCursor:
        self.cursor = PassCursor(cursor)
        return self.cursor

    def lm_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.lm_head_rows(ids)

    def norm_weight(self) -> torch.Tensor:
        return self.weights.norm_weight()

    def last_layer(self) -> None:
        return None  # streamed: no layer stays in memory

    def flops_per_token(self, extra: int) -> float:
        decoder = self.streamer.decoder  # on the meta device: shapes only
        return flops.target_flops_per_token(decoder, decoder.embed_tokens.parameters(), extra, self.streamer.config)

    def attention_flops(self, pairs: int) -> float:
        return flops.target_attention_flops(self.streamer.config, pairs)

    def feature_source(self, aux_layer_ids: Sequence[int], vocab: Any, cfg: Any) -> StreamedFeatures:
        if tuple(aux_layer_ids) != tuple(self.aux_layer_ids):
            raise UserError(f"aux layer ids {list(aux_layer_ids)} differ from the streamed target's "
                            f"{list(self.aux_layer_ids)}")
        ids = vocab.draft_ids
        bias = self.weights.lm_head_bias(ids)
        teacher = TeacherHead(self.weights.lm_head_rows(ids).to(self.device, self.dtype),
                              None if bias is None else bias.to(self.device, self.dtype),
                              self.config.get("final_logit_softcapping"))
        stored = {torch.float32: "float32", torch.bfloat16: "bf16"}.get(self.dtype)
        if stored is None:
            raise UserError(f"--stream-layers trains in float32 or bfloat16, not {self.dtype}")
        evals = self.splits["eval"]
        count = 0 if evals is None else (len(evals) if cfg.eval_examples is None
                                         else min(cfg.eval_examples, len(evals)))
        store = _PassStore(self.streamer, self.splits, stored)
        return StreamedFeatures(store, self.cursor, count, self.index, teacher, self.device, self.dtype)

    def close(self) -> None:
        self.streamer.close()
