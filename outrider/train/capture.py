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
- Both tensors are in the target's dtype and on its device. Nothing goes to disk; the target
  stays in memory and the hooks stay attached until ``close()``.
- Padding: ``attention_mask`` [batch, seq] (1 = real token) is passed through, with position
  ids counted over the real tokens (so left and right padding both work). Values at padded
  positions are meaningless and must be masked by the consumer.

Not done here: compiling the target's forward (tried: on an H200 its first dynamic-shape compilation
of the default model had not finished after eight minutes, and on a tiny float32 target its losses
drifted from eager by 2.7e-4 relative), storing hidden states offline, quantised targets, tensor- or pipeline-parallel
targets, target-side logit transforms other than soft-capping (logit scales, temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.nn import functional as F

from outrider.models import AuxCapture


@dataclass
class Captured:
    aux: torch.Tensor  # [batch, seq, len(aux_layer_ids) * H_t]
    teacher: torch.Tensor  # [batch, seq, draft_vocab] target logits on the draft vocabulary, unnormalised


class TargetCapture:
    """A frozen target bound for capture; call it on batches, ``close()`` it when done."""

    def __init__(self, target: torch.nn.Module, aux_layer_ids: Sequence[int], draft_ids: Any):
        # draft_ids: [draft_vocab] target ids (or a ``DraftVocab``, whose ``draft_ids`` are used)
        self.target = target.eval().requires_grad_(False)
        self.decoder = target.get_decoder()
        self.aux_capture = AuxCapture(target, aux_layer_ids)
        lm_head = target.get_output_embeddings()
        ids = torch.as_tensor(getattr(draft_ids, "draft_ids", draft_ids), dtype=torch.long,
                              device=lm_head.weight.device)
        self.weight = lm_head.weight.detach().index_select(0, ids)  # [draft_vocab, H_t]
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else bias.detach().index_select(0, ids)  # [draft_vocab]
        self.softcap = getattr(target.config, "final_logit_softcapping", None)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.aux_capture.layer_ids

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Captured:
        # input_ids: [batch, seq]; attention_mask: [batch, seq], 1 on real tokens
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # [batch, seq]
        try:
            aux, teacher = self._forward(input_ids, attention_mask, position_ids)
        finally:
            self.aux_capture.states.clear()
        return Captured(aux=aux, teacher=teacher)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False)
        final = out.last_hidden_state  # [batch, seq, H_t], after the final norm
        aux = self.aux_capture.concat()  # [batch, seq, 3*H_t]
        teacher = F.linear(final, self.weight, self.bias)  # [batch, seq, draft_vocab]
        if self.softcap:
            teacher = torch.tanh(teacher / self.softcap) * self.softcap
        return aux, teacher

    def close(self) -> None:
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
