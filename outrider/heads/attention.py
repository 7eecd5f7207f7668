"""The draft head's attention over its own keys: GQA projections and the attention both kinds share.

Contract:
- ``attend(q, k, v, mask, cache, num_heads, scale)``: queries ``[B, heads, n, d]`` over keys
  ``[B, kv, S, d]`` and values ``[B, kv, S, d_v]`` (``d_v`` may differ from ``d``: MLA), through
  the cache when given (``cache.update(k, v, 0)`` hands back everything it holds) -> ``[B, n,
  heads * d_v]``. A few queries over a cache go through ``slot_attention`` (two matrix
  products); prompts and training go through SDPA (grouped keys expanded). ``scale`` None is
  ``d ** -0.5``. ``mask``: ``[B, 1, n, S]`` additive float or bool (True = may attend); None =
  causal (the n queries being the last n keys).
- ``window_mask(q_pos, k_pos, window)``: who may see whom by position, causal and, with a
  ``window`` W > 0, only the last W positions (the query's own included), as vLLM's and
  speculators' sliding window count them.
- ``GQAAttention``: the Llama attention of an EAGLE-3 layer, q/k/v over the 2H-wide input,
  rotate-half rotary.

Not done here: the MLA projections (``outrider.heads.mla``), the slots and masks of a decode cache
(``outrider.decode.proposers.head_cache.HeadCache``), dropout, soft-capping.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from outrider.ops.slot_attention import slot_attention

SLOT_QUERIES = 64  # up to this many queries over a cache attend by slot_attention (a draft step)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Bool ``[..., n, S]``: key at ``k_pos`` visible from query at ``q_pos`` (causal; within the
    last ``window`` positions when ``window`` > 0). q_pos: [..., n]; k_pos: [..., S]."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]  # [..., n, S]
    sees = diff >= 0
    if window > 0:
        sees &= diff < window
    return sees


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
           cache: Any | None, scale: float | None = None) -> torch.Tensor:
    """Attention of q over k, v (see the module docstring) -> [B, n, heads * d_v]."""
    B, H, n, _ = q.shape
    if cache is not None:
        k, v = cache.update(k, v, 0)  # [B, kv, S, d], [B, kv, S, d_v]: everything the cache hands back
        if attention_mask is None:
            attention_mask = cache.attention_mask(
                torch.ones(B, n, dtype=torch.bool, device=q.device),
                torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), q.dtype)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(q.dtype)
    if cache is not None and n <= SLOT_QUERIES:  # drafting: two matrix products, no flash kernel walking S
        out, _ = slot_attention(None, q, k, v, attention_mask, scaling=scale)  # [B, n, heads, d_v]
        return out.reshape(B, n, -1)
    g = H // k.shape[1]
    if g > 1:  # GQA by expansion: keeps the masked fused kernels usable
        k = k[:, :, None].expand(-1, -1, g, -1, -1).flatten(1, 2)  # [B, heads, S, d]
        v = v[:, :, None].expand(-1, -1, g, -1, -1).flatten(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None,
                                         scale=scale)  # [B, heads, n, d_v]
    return out.transpose(1, 2).reshape(B, n, -1)


class DraftAttention(nn.Module):
    """What every head attention shares: ``project`` (the subclass's) -> ``attend`` -> ``o_proj``."""

    scaling: float | None = None  # the softmax scale (None: SDPA's default, head_dim ** -0.5)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
               cache: Any | None) -> torch.Tensor:
        """``attend`` with this layer's scale -> [B, n, heads * d_v], before ``o_proj``."""
        return attend(q, k, v, attention_mask, cache, self.scaling)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any | None) -> torch.Tensor:
        # x: [batch, n, 2H]; cos/sin: [batch, n, rotary width]
        q, k, v = self.project(x, cos, sin)
        return self.o_proj(self.attend(q, k, v, attention_mask, cache))


class GQAAttention(DraftAttention):
    """Llama attention over a 2H-wide input; keys/values through an optional slot cache."""

    def __init__(self, config: Any):
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.v_head_dim = d
        self.q_proj = nn.Linear(2 * H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, n, d] and k, v [B, kv, n, d] of x [B, n, 2H], rotary applied to q and k."""
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, self.num_heads, self.head_dim).transpose(1, 2)  # [B, heads, n, d]
        k = self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, n, d]
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v
