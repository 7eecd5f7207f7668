"""Online capture from the frozen target: aux hidden states and the teacher over the draft vocabulary.

Contract:
- ``TargetCapture(target, aux_layer_ids, draft_ids)`` binds a stock ``transformers`` causal LM
  (Llama, DeepSeek-V3, ... anything whose decoder layers sit in ``model.model.layers``) and
  keeps it frozen. Each call runs one ``no_grad`` forward of the target's decoder over a batch
  and returns ``Captured``:
  * ``aux`` [batch, seq, 3*H_t]: the hidden states entering decoder layers ``aux_layer_ids``
    (Hugging Face ``output_hidden_states[j]``), concatenated in the given order, by forward
    pre-hooks (``outrider.models.AuxCapture``); no modeling file is forked.
  * ``teacher`` [batch, seq, draft_vocab]: the target's **logits restricted to the draft
    vocabulary**, unnormalised: the final hidden state (after the final norm) times the rows
    ``draft_ids`` of the frozen ``lm_head`` (plus its bias, and the final soft-capping where the
    config has one). Row ``t`` is the target's prediction of token ``t+1``. Consumers
    renormalise over the draft vocabulary (``log_softmax``), as ``outrider.train.loop.ttt`` does.
  Full-vocabulary logits are never computed: the decoder runs without its ``lm_head``.
- Both tensors are in the target's dtype and on its device (``device``, for a target placed
  across devices by accelerate). Nothing goes to disk; the target stays in memory and the hooks
  stay attached until ``close()``.
- Padding: ``attention_mask`` [batch, seq] (1 = real token) is passed through, with position
  ids counted over the real tokens (so left and right padding both work). Values at padded
  positions are meaningless and must be masked by the consumer.
- ``graphs=True`` with ``max_tokens`` (CUDA, ``graphable`` targets: dense, full causal attention
  in every layer, no soft-capping): each batch shape's forward is
  captured once as a CUDA graph and replayed (a step of a small target is otherwise bound by
  the host launching ~1,600 kernels). The graphs share one memory pool and write into
  persistent buffers of ``max_tokens`` rows, so the returned tensors are **valid until the next
  call**. The graphed forward takes an explicit 4-D mask (causal over real keys, each position
  seeing itself, so no row is empty); larger batches and a capture that fails (noted in
  ``notes``; best effort: a failed capture may leave the allocator's capture state behind) run
  eager. ``features(batch)`` is the same call on a training ``Batch`` (``outrider.train.states.features``).
- The pieces are shared with the cache: ``TeacherHead`` (final states -> the teacher, from a
  loaded target's ``lm_head`` or from rows read elsewhere), ``decoder_states`` (one hooked
  forward: aux and final states), and ``ModelSource``, the in-memory hidden-state source of
  ``outrider.train.states.cache_capture`` (per-sequence aux and final states, batched by padded tokens).

Not done here: compiling the target's forward (tried: its dynamic-shape compilation took longer than
it saved, and its losses were not equal to eager), writing hidden states to disk (``outrider.train.states.cache``),
quantised targets, tensor- or pipeline-parallel targets, target-side logit transforms other than
soft-capping (logit scales, temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from outrider.ops.graphs import capture_graph, graphable
from outrider.models import AuxCapture, input_device, is_dispatched, resident_weight


@dataclass
class Captured:
    aux: torch.Tensor  # [batch, seq, len(aux_layer_ids) * H_t]
    teacher: torch.Tensor  # [batch, seq, draft_vocab] target logits on the draft vocabulary, unnormalised


def real_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted over the real tokens: [batch, seq] (padding either side)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def context_mask(real: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``[batch, 1, S, S]`` (True = may attend): each query sees the real keys up to
    it and itself, so no row is empty. real: [batch, S] bool."""
    S = real.shape[1]
    eye = torch.eye(S, dtype=torch.bool, device=real.device)
    return (eye | (torch.ones_like(eye).tril() & real[:, None, :]))[:, None]


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, S] 0/1 -> [batch, 1, S, S] additive mask in ``dtype``. Given to the model as is, it
    spares transformers' check of a 2-D mask for padding, a host round trip."""
    B, S = attention_mask.shape
    return torch.zeros(B, 1, S, S, dtype=dtype, device=attention_mask.device).masked_fill_(
        ~context_mask(attention_mask.bool()), torch.finfo(dtype).min)


def decoder_states(decoder: torch.nn.Module, aux_capture: AuxCapture, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of a stock decoder (its ``lm_head`` left out) with ``aux_capture``'s hooks on:
    (aux [batch, seq, n_aux*H_t], final [batch, seq, H_t] after the final norm)."""
    out = decoder(input_ids=input_ids, attention_mask=additive_mask(attention_mask, dtype),
                  position_ids=real_positions(attention_mask), use_cache=False)
    return aux_capture.concat(), out.last_hidden_state


class TeacherHead:
    """The frozen ``lm_head`` rows of the draft vocabulary: final states -> the target's logits on the
    draft vocabulary (bias and final soft-capping included, as the target applies them)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, softcap: float | None = None):
        self.weight = weight  # [draft_vocab, H_t]
        self.bias = bias  # [draft_vocab] or None
        self.softcap = softcap

    @classmethod
    def of(cls, target: torch.nn.Module, draft_ids: Any, device: torch.device | str | None = None) -> "TeacherHead":
        """The rows ``draft_ids`` (or a ``DraftVocab``'s) of a loaded target's ``lm_head``, on ``device``
        (default: the lm_head's; offloaded by accelerate: read from its offloaded copy)."""
        lm_head = target.get_output_embeddings()
        weight = resident_weight(lm_head)
        device = torch.device(device) if device is not None else weight.device
        ids = torch.as_tensor(getattr(draft_ids, "draft_ids", draft_ids), dtype=torch.long, device=weight.device)
        bias = None if getattr(lm_head, "bias", None) is None else resident_weight(lm_head, "bias")
        return cls(weight.detach().index_select(0, ids).to(device),
                   None if bias is None else bias.detach().index_select(0, ids).to(device),
                   getattr(target.config, "final_logit_softcapping", None))

    def into(self, final: torch.Tensor, teacher: torch.Tensor) -> None:
        """final [..., H_t] -> teacher [..., draft_vocab], written in place."""
        rows = teacher.view(-1, teacher.shape[-1])  # [N, draft_vocab]
        final = final.reshape(-1, final.shape[-1])  # [N, H_t]
        if self.bias is not None:
            torch.addmm(self.bias, final, self.weight.t(), out=rows)
        else:
            torch.mm(final, self.weight.t(), out=rows)
        if self.softcap:
            rows.div_(self.softcap).tanh_().mul_(self.softcap)

    def __call__(self, final: torch.Tensor) -> torch.Tensor:
        """final [N, H_t] -> logits [N, draft_vocab]."""
        teacher = final.new_empty(final.shape[0], self.weight.shape[0])
        self.into(final, teacher)
        return teacher


class TargetCapture:
    """A frozen target bound for capture; call it on batches, ``close()`` it when done."""

    def __init__(self, target: torch.nn.Module, aux_layer_ids: Sequence[int], draft_ids: Any,
                 graphs: bool = False, max_tokens: int = 0, device: torch.device | str | None = None):
        # draft_ids: [draft_vocab] target ids (or a ``DraftVocab``, whose ``draft_ids`` are used)
        # device: where the outputs go (default: lm_head's; a target placed by accelerate: give it)
        self.target = target.eval().requires_grad_(False)
        self.decoder = target.get_decoder()
        self.aux_capture = AuxCapture(target, aux_layer_ids)
        self.teacher = TeacherHead.of(target, draft_ids, device)
        self.weight = self.teacher.weight  # [draft_vocab, H_t]
        self.graphs = (bool(graphs) and max_tokens > 0 and self.weight.is_cuda and graphable(target)
                       and not is_dispatched(target))
        self.max_tokens = max_tokens
        self.notes: list[str] = []
        self._graphs: dict[tuple[int, int], tuple] = {}  # (batch, seq) -> graph, its inputs, its outputs
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # flat aux and teacher rows
        self._pool = None

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.aux_capture.layer_ids

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Captured:
        # input_ids: [batch, seq]; attention_mask: [batch, seq], 1 on real tokens
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if self.graphs and input_ids.numel() <= self.max_tokens:
            return self._replay(input_ids, attention_mask)
        try:
            aux, teacher = self._forward(input_ids, attention_mask)
        finally:
            self.aux_capture.states.clear()
        return Captured(aux=aux, teacher=teacher)

    def _additive_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        return additive_mask(attention_mask, self.weight.dtype)

    def features(self, batch: Any) -> Captured:
        """The features of a training ``Batch`` (``input_ids``, ``attention_mask``), as every feature
        source gives them (``outrider.train.states.features``)."""
        return self(batch.input_ids, batch.attention_mask)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aux, final = decoder_states(self.decoder, self.aux_capture, input_ids, attention_mask, self.weight.dtype)
        aux, final = aux.to(self.weight.device), final.to(self.weight.device)  # placed by accelerate: one device
        teacher = final.new_empty(*final.shape[:2], self.weight.shape[0])  # [batch, seq, draft_vocab]
        self.teacher.into(final, teacher)
        return aux, teacher

    def write_into(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux: torch.Tensor,
                   teacher: torch.Tensor) -> None:
        """The forward a graph records: aux [batch, seq, 3*H_t] and teacher [batch, seq, draft_vocab]
        written into the given tensors, with an explicit 4-D mask (no host synchronisation)."""
        try:
            out = self.decoder(input_ids=input_ids, attention_mask=self._additive_mask(attention_mask),
                               position_ids=real_positions(attention_mask), use_cache=False)
            self.aux_capture.concat(out=aux)
        finally:
            self.aux_capture.states.clear()
        self.teacher.into(out.last_hidden_state, teacher)

    def _replay(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Captured:
        key = (int(input_ids.shape[0]), int(input_ids.shape[1]))
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(*key)
            except (RuntimeError, ValueError, TypeError) as e:  # a forward that cannot be captured: eager from now on
                self.graphs, self._buffers, self._pool = False, None, None
                self.notes.append(f"the target's forward runs eager: its CUDA graph capture failed ({e})"[:300])
                if input_ids.is_cuda:
                    torch.cuda.synchronize(input_ids.device)
                return self(input_ids, attention_mask)
            self._graphs[key] = entry
        graph, ids, mask, aux, teacher = entry
        ids.copy_(input_ids)
        mask.copy_(attention_mask)
        graph.replay()
        return Captured(aux=aux, teacher=teacher)

    def _capture(self, B: int, S: int) -> tuple:
        dev, dtype = self.weight.device, self.weight.dtype
        width = len(self.aux_layer_ids) * self.weight.shape[1]
        if self._buffers is None:  # outside the pool: every graph writes its outputs here
            self._buffers = (torch.empty(self.max_tokens * width, dtype=dtype, device=dev),
                             torch.empty(self.max_tokens * self.weight.shape[0], dtype=dtype, device=dev))
            self._pool = torch.cuda.graph_pool_handle()
        aux = self._buffers[0][:B * S * width].view(B, S, width)
        teacher = self._buffers[1][:B * S * self.weight.shape[0]].view(B, S, -1)
        ids = torch.zeros(B, S, dtype=torch.long, device=dev)
        mask = torch.ones(B, S, dtype=torch.long, device=dev)
        graph, _ = capture_graph(lambda: self.write_into(ids, mask, aux, teacher), dev, warmups=2, pool=self._pool)
        return graph, ids, mask, aux, teacher

    def close(self) -> None:
        self._graphs.clear()
        self.aux_capture.close()

    def __enter__(self) -> "TargetCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def capture(target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            aux_layer_ids: Sequence[int], draft_ids: Any) -> Captured:
    """One-shot ``TargetCapture`` (hooks attached for this call only)."""
    with TargetCapture(target, aux_layer_ids, draft_ids) as cap:
        return cap(input_ids, attention_mask)


class ModelSource:
    """The in-memory hidden-state source of ``outrider.train.states.cache_capture``: a stock model and
    ``AuxCapture`` hooks. ``states(input_ids)`` runs the sequences (sorted by length, right-padded)
    in batches of at most ``batch_tokens`` padded tokens and returns each one's
    (aux [len, n_aux*H_t], final [len, H_t] after the final norm), on the model's device."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: Sequence[int], batch_tokens: int = 4096):
        self.model = model.eval().requires_grad_(False)
        self.decoder = model.get_decoder()
        self.aux = AuxCapture(model, aux_layer_ids, attach=False)
        self.aux_layer_ids = self.aux.layer_ids
        self.hidden_size = int(model.config.get_text_config().hidden_size)
        self.batch_tokens = int(batch_tokens)
        self.pass_tokens = 4 * self.batch_tokens  # tokens the capture hands over per call
        self.device, self.dtype = input_device(model), model.dtype  # placed by accelerate: where the ids go

    @torch.no_grad()
    def states(self, input_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(input_ids)
        order = sorted(range(len(input_ids)), key=lambda i: len(input_ids[i]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end + 1 - start) * len(input_ids[order[end]]) <= self.batch_tokens:
                end += 1
            group = order[start:end]
            width = len(input_ids[group[-1]])
            ids = torch.zeros(len(group), width, dtype=torch.long)  # [batch, seq]
            mask = torch.zeros(len(group), width, dtype=torch.long)  # [batch, seq]
            for b, i in enumerate(group):
                ids[b, :len(input_ids[i])] = torch.as_tensor(input_ids[i])
                mask[b, :len(input_ids[i])] = 1
            with self.aux.attached():
                try:
                    aux, final = decoder_states(self.decoder, self.aux, ids.to(self.device), mask.to(self.device),
                                                self.dtype)
                finally:
                    self.aux.states.clear()
            for b, i in enumerate(group):
                n = len(input_ids[i])
                out[i] = (aux[b, :n], final[b, :n])
            start = end
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.aux.close()

    def __enter__(self) -> "ModelSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
