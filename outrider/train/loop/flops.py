"""FLOPs of an EAGLE-3 training step, for the trainer's MFU.

Contract (multiply-adds count 2 FLOPs; a backward costs twice its forward):
- ``target_flops_per_token(decoder, skip, extra, config)``: one token through the frozen
  target's forward: 2 x the decoder's weight matrices (those in ``skip``, the embedding, and
  vectors such as norm weights excluded),
  routed experts counted at ``experts_per_token / num_experts`` of their size (a token runs only
  its top-k experts), plus 2 x ``extra`` (the draft rows of lm_head the teacher uses).
- ``causal_pairs(lengths)``: the (query, key) pairs of causal attention over sequences of these
  real lengths, ``sum T (T + 1) / 2``.
- ``target_attention_flops(config, pairs)``: the forward's attention products (``q k^T`` and
  ``p v``) over ``pairs``: ``2 x pairs x heads x (d_qk + d_v)`` per layer; MLA's ``d_qk`` is the
  nope + rope width and ``d_v`` its value width.
- ``head_flops(body, lm, tokens, counted, steps)``: the head's forward and backward over
  ``steps`` unrolled steps, weights only: ``6 x body x tokens`` per step for the layer,
  ``6 x lm x counted`` for lm_head at the counted positions.
- ``head_attention_flops(config, tokens, pairs, steps)``: the head's attention products,
  forward and backward: step ``j`` attends over the causal context plus its ``j`` diagonal keys,
  ``pairs + j x tokens`` pairs.
Padding is never counted; nor are the softmax, norms and other elementwise work.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch

from outrider.models import arch_info

_ROUTED = re.compile(r"(^|\.)experts\.")  # routed experts (not shared_experts)


def target_flops_per_token(decoder: torch.nn.Module, skip: Iterable[torch.nn.Parameter], extra: int,
                           config: Any) -> float:
    info = arch_info(config)
    share = info.experts_per_token / info.num_experts if info.is_moe and info.experts_per_token else 1.0
    skipped = {id(p) for p in skip}
    params = 0.0
    for name, p in decoder.named_parameters():
        if id(p) in skipped or p.dim() < 2:  # vectors (norm weights, biases) scale, they multiply nothing
            continue
        params += p.numel() * (share if _ROUTED.search(name) else 1.0)
    return 2.0 * (params + extra)


def causal_pairs(lengths: Iterable[int]) -> int:
    return sum(int(t) * (int(t) + 1) // 2 for t in lengths)


def target_attention_flops(config: Any, pairs: int) -> float:
    info = arch_info(config)
    if info.attention == "MLA":
        d_qk, d_v = info.qk_nope_head_dim + info.qk_rope_head_dim, info.v_head_dim
    else:
        d_qk = d_v = info.head_dim
    return 2.0 * pairs * info.num_heads * (d_qk + d_v) * info.num_layers


def head_flops(body: int, lm: int, tokens: int, counted: float, steps: int) -> float:
    return 6.0 * body * tokens * steps + 6.0 * lm * counted


def head_attention_flops(config: Any, tokens: int, pairs: int, steps: int) -> float:
    # query heads x (key width for q k^T + value width for p v); MLA values are narrower than its keys
    width = config.num_attention_heads * (config.head_dim + getattr(config, "value_dim", config.head_dim))
    return sum(6.0 * (pairs + j * tokens) * width for j in range(steps))


def dflash_flops(config: Any, body: int, lm: int, tokens: int, counted: torch.Tensor, pairs: int) -> tuple[float, float]:
    """(weights FLOPs, attention FLOPs) of a DFlash drafter's forward and backward over a step: every
    anchor's block of ``block_size`` positions through the layers (anchors: the positions counted at
    the first draft), lm_head at the counted positions, each block attending over the mean context
    (``pairs / tokens``) and itself."""
    m, anchors = config.block_size, float(counted[0])
    weights = 6.0 * body * anchors * m + 6.0 * lm * float(counted.sum())
    span = pairs / max(tokens, 1) + m
    return weights, 12.0 * anchors * m * span * config.num_attention_heads * config.head_dim * config.num_hidden_layers
