"""Where a fresh draft head's weights start: from the target's own weights, or from another head.

Contract: ``init_from_target`` copies the target's lm_head rows of the draft vocabulary and its
final norm into the head (shapes that differ are skipped); ``init_layer_from_target`` makes the
head's decoder layer start as the target's last decoder layer applied to the last aux state
(``UserError`` when the shapes differ or no layer is at hand); ``check_init_fits`` refuses an
``--init`` head built for another target. All write in place under ``no_grad`` and return nothing.
``mask_token_id`` picks a parallel-drafting head's placeholder token from the target's tokenizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from outrider.errors import UserError
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head


@torch.no_grad()
def init_from_target(head: Eagle3Head, target: Any, draft_ids: torch.Tensor, need_rows: bool = False) -> None:
    """lm_head <- the target's lm_head rows of the draft vocabulary; norm <- the target's final norm.

    The head then starts by reading its hidden state the way the target reads its last one,
    which shortens training; the rest stays randomly initialised. ``target`` is any feature
    source with ``lm_rows(ids)`` and ``norm_weight()`` (online, cached or streamed). Rows of
    another shape are skipped, unless ``need_rows`` (a frozen lm_head): then ``UserError``.
    """
    rows = target.lm_rows(draft_ids)  # [draft_vocab, H] or None
    if rows is not None and tuple(rows.shape[1:]) == (head.config.hidden_size,):
        head.lm_head.weight.copy_(rows.float().cpu())
    elif need_rows:
        raise UserError("freeze_lm_head needs the target's lm_head rows, and this target side has none of the "
                        "head's width: drop freeze_lm_head")
    weight = target.norm_weight()  # [H] or None
    if weight is not None and tuple(weight.shape) == tuple(head.norm.weight.shape):
        head.norm.weight.copy_(weight.detach().float().cpu())


@torch.no_grad()
def init_layer_from_target(head: Eagle3Head, layer: nn.Module | None) -> None:
    """The draft layer <- the target's last decoder ``layer``; ``fc`` <- the last aux state passed through.

    The layer's projections read ``[input_layernorm(e); hidden_norm(h)]``: the hidden half gets
    the target layer's weights, the embedding half starts at zero, so that at step 0 the head
    computes the target's last layer on its last aux state.
    """
    if layer is None:
        raise UserError("init_layer_from_target needs the target in memory (its last decoder layer): "
                        "train online, without --cache or --stream-layers, or without this option")
    mid, H = head.midlayer, head.config.hidden_size
    pairs = [(mid.mlp.gate_proj, getattr(layer.mlp, "gate_proj", None)), (mid.mlp.up_proj, getattr(layer.mlp, "up_proj", None)),
             (mid.mlp.down_proj, getattr(layer.mlp, "down_proj", None)), (mid.self_attn.o_proj, layer.self_attn.o_proj),
             (mid.post_attention_layernorm, layer.post_attention_layernorm),
             (mid.hidden_norm, layer.input_layernorm)]
    projections = [(getattr(mid.self_attn, n, None), getattr(layer.self_attn, n, None)) for n in ("q_proj", "k_proj", "v_proj")]
    bad = [n for (ours, theirs), n in zip(pairs, ("gate", "up", "down", "o", "post norm", "norm"))
           if theirs is None or ours.weight.shape != theirs.weight.shape]
    bad += [n for (ours, theirs), n in zip(projections, "qkv")
            if ours is None or theirs is None or ours.weight.shape != (theirs.weight.shape[0], 2 * theirs.weight.shape[1])]
    if bad or head.config.target_hidden_size != H:
        raise UserError(f"init_layer_from_target: the head's layer does not have the target's last layer's shapes "
                        f"({', '.join(bad) or 'hidden size'}): train without it")
    for ours, theirs in pairs:
        ours.weight.copy_(theirs.weight.float())
    for ours, theirs in projections:  # ours: [out, 2H] over [e; h]
        ours.weight.zero_()
        ours.weight[:, H:].copy_(theirs.weight.float())  # the hidden half; the embedding half stays 0
    fc = head.fc.weight  # [H, 3 H_t]: pass the last aux state through
    fc.zero_()
    fc[:, 2 * H:].copy_(torch.eye(H))


def check_init_fits(have: Eagle3Config, want: Eagle3Config) -> None:
    """An ``--init`` head must match this target's sizes, vocabulary and aux ids."""
    keys = ("hidden_size", "vocab_size", "draft_vocab_size", "target_hidden_size", "aux_layer_ids")
    bad = [k for k in keys if getattr(have, k) != getattr(want, k)]
    if bad:
        diff = ", ".join(f"{k} {getattr(have, k)} vs {getattr(want, k)}" for k in bad)
        raise UserError(f"the --init head does not fit this target ({diff}): train from scratch instead")


def mask_token_id(tokenizer: Any) -> int:
    """P-EAGLE's placeholder token when the settings name none: the tokenizer's pad, else unk, else
    eos id (speculators' ``resolve_mask_token_id`` falls back the same way); ``UserError`` if none."""
    for name in ("pad_token_id", "unk_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    raise UserError("a parallel-drafting head needs a placeholder token and the target's tokenizer has no pad, unk "
                    "or eos token: set 'mask_token_id' in a --config file")
