"""Attention for the engine's cached steps: a few new queries against a whole slot buffer.

Contract: ``slot_attention`` is a ``transformers`` attention function (``AttentionInterface``):
query ``[B, H, n, d]``, key ``[B, H_kv, S, d]``, value ``[B, H_kv, S, d_v]`` and an additive float
or boolean mask ``[B, 1, n, S]`` (None: causal, the queries being the last n keys) give
``([B, n, H, d_v], None)`` =
``softmax(q k^T * scale + mask) v``. The query heads are grouped by the key/value head they read
(query head ``h`` reads ``h // g``, as ``repeat_kv`` pairs them), so keys and values are read in
place, never copied per query head; the softmax runs in float32. Two batched matrix products,
whatever n: meant for n <= 64 new tokens per row (a decode step, a verification, a draft step),
where a general attention kernel walks the S slots serially for a handful of queries.

``using_slot_attention(model)`` switches every attention of a model to it for the duration of a
``with`` block (the engine captures its CUDA graphs inside one; a replay no longer looks at the
setting) and restores the model's own implementation after.

Not done here: prefill and training keep the model's own attention; no dropout, no soft-capping,
no sliding window (a model that needs one keeps its own attention: see ``supports``).
"""

from __future__ import annotations

import contextlib

import torch

NAME = "outrider_slots"
UNSUPPORTED = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")  # attention arguments it would ignore


def slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs) -> tuple[torch.Tensor, None]:
    unsupported = [k for k in UNSUPPORTED if kwargs.get(k) is not None]
    if unsupported or dropout:
        raise ValueError(f"slot_attention does not implement {', '.join(unsupported) or 'dropout'}: "
                         "use SpecEngine(attention='model') for this model")
    B, H, n, d = query.shape
    H_kv, S = key.shape[1], key.shape[2]
    g = H // H_kv
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(B, H_kv, g * n, d)  # [B, H_kv, g*n, d]: the g query heads of each key/value head
    scores = torch.matmul(q, key.transpose(-1, -2)).view(B, H_kv, g, n, S) * scale  # [B, H_kv, g, n, S]
    if attention_mask is None:  # causal, the n queries being the last n keys
        mask = torch.ones(n, S, dtype=torch.bool, device=query.device).tril(S - n)  # [n, S]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        if attention_mask.shape[1] != 1:
            raise ValueError(f"slot_attention takes one mask for all heads, got {tuple(attention_mask.shape)}")
        mask = attention_mask[:, :, None, :, :S]  # [B, 1, 1, n, S]: the first S columns, as transformers
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(B, H_kv, g * n, S), value)  # [B, H_kv, g*n, d_v]
    return out.view(B, H, n, -1).transpose(1, 2).contiguous(), None  # [B, n, H, d_v]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, slot_attention)


def supports(model: torch.nn.Module) -> bool:
    """Can this model's attention be replaced? Not with sliding windows or soft-capped logits."""
    cfg = getattr(model.config, "text_config", None) or model.config
    return not (getattr(cfg, "sliding_window", None) or getattr(cfg, "attn_logit_softcapping", None)
                or getattr(cfg, "use_sliding_window", False))


@contextlib.contextmanager
def using_slot_attention(model: torch.nn.Module, enabled: bool = True):
    """Every attention of ``model`` is ``slot_attention`` inside the block (if ``enabled`` and the
    model ``supports`` it); the model's own implementation is restored after."""
    if not (enabled and supports(model)):
        yield
        return
    _register()
    original = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
