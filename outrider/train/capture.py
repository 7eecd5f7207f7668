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
    renormalise over the draft vocabulary (``log_softmax``), as ``outrider.train.ttt`` does.
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
  eager.

Not done here: compiling the target's forward (tried: on an H200 its first dynamic-shape compilation
of the default model had not finished after eight minutes, and on a tiny float32 target its losses
drifted from eager by 2.7e-4 relative), storing hidden states offline, quantised targets, tensor- or pipeline-parallel
targets, target-side logit transforms other than soft-capping (logit scales, temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from outrider.decode.graphs import capture_graph, graphable
from outrider.models import AuxCapture, is_dispatched, resident_weight


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


class TargetCapture:
    """A frozen target bound for capture; call it on batches, ``close()`` it when done."""

    def __init__(self, target: torch.nn.Module, aux_layer_ids: Sequence[int], draft_ids: Any,
                 graphs: bool = False, max_tokens: int = 0, device: torch.device | str | None = None):
        # draft_ids: [draft_vocab] target ids (or a ``DraftVocab``, whose ``draft_ids`` are used)
        # device: where the outputs go (default: lm_head's; a target placed by accelerate: give it)
        self.target = target.eval().requires_grad_(False)
        self.decoder = target.get_decoder()
        self.aux_capture = AuxCapture(target, aux_layer_ids)
        lm_head = target.get_output_embeddings()
        weight = resident_weight(lm_head)  # offloaded by accelerate: its CPU copy
        device = torch.device(device) if device is not None else weight.device
        ids = torch.as_tensor(getattr(draft_ids, "draft_ids", draft_ids), dtype=torch.long, device=weight.device)
        self.weight = weight.detach().index_select(0, ids).to(device)  # [draft_vocab, H_t]
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else resident_weight(lm_head, "bias").detach().index_select(0, ids).to(device)
        self.softcap = getattr(target.config, "final_logit_softcapping", None)
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
        """[batch, S] 0/1 -> [batch, 1, S, S] additive mask in the weights' dtype. Given to the
        model as is, it spares transformers' check of a 2-D mask for padding, a host round trip."""
        dtype = self.weight.dtype
        B, S = attention_mask.shape
        return torch.zeros(B, 1, S, S, dtype=dtype, device=attention_mask.device).masked_fill_(
            ~context_mask(attention_mask.bool()), torch.finfo(dtype).min)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.decoder(input_ids=input_ids, attention_mask=self._additive_mask(attention_mask),
                           position_ids=real_positions(attention_mask), use_cache=False)
        final = out.last_hidden_state.to(self.weight.device)  # [batch, seq, H_t], after the final norm
        aux = self.aux_capture.concat().to(self.weight.device)  # [batch, seq, 3*H_t]
        teacher = final.new_empty(*final.shape[:2], self.weight.shape[0])  # [batch, seq, draft_vocab]
        self._teacher_into(final, teacher)
        return aux, teacher

    def _teacher_into(self, final: torch.Tensor, teacher: torch.Tensor) -> None:
        """The target's logits on the draft vocabulary: final [batch, seq, H_t] -> teacher [batch, seq,
        draft_vocab], written in place (bias and soft-capping included)."""
        rows = teacher.view(-1, teacher.shape[-1])  # [batch*seq, draft_vocab]
        final = final.reshape(-1, final.shape[-1])  # [batch*seq, H_t]
        if self.bias is not None:
            torch.addmm(self.bias, final, self.weight.t(), out=rows)
        else:
            torch.mm(final, self.weight.t(), out=rows)
        if self.softcap:
            rows.div_(self.softcap).tanh_().mul_(self.softcap)

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
        self._teacher_into(out.last_hidden_state, teacher)

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
