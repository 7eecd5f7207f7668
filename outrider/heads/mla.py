"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as the attention of an EAGLE-3 layer.

Contract (the draft SGLang's ``kimi_k25_eagle3.py`` and vLLM's ``deepseek_eagle3.py`` serve as
``Eagle3DeepseekV2ForCausalLM``):
- The down-projections take the layer's 2H-wide input ``x = [input_layernorm(e); hidden_norm(h)]``:
  ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` per head ``[nope | rope]``; ``kv_a_proj_with_mqa(x)``
  = ``[c (kv_lora_rank) | k_rope (qk_rope_head_dim, one head shared by all)]``, ``c`` normed by
  ``kv_a_layernorm``; ``kv_b_proj(c)`` per head ``[k_nope | v]``; ``o_proj`` [H, heads * v_head_dim].
- Rotary on the rope slices only, in DeepSeek's interleaved pairs (x[2i], x[2i+1]), with the
  target's YaRN settings (``transformers``' ``apply_rotary_pos_emb_interleave``: the scores are
  those of the engines' GPT-J rotation). Softmax scale ``(nope + rope) ** -0.5``, times
  ``mscale(factor, mscale_all_dim) ** 2`` under YaRN, as SGLang, vLLM and ``transformers`` do.
- Keys and values are handed to the cache expanded per head (``k [B, heads, n, nope + rope]``,
  ``v [B, heads, n, v_head_dim]``): the GQA head's cache protocol (``cache.update(k, v, 0)``),
  the same TTT, slot attention and flex attention code, exact in training and drafting alike.
  The engines cache the latent instead (``kv_lora_rank + qk_rope_head_dim`` values per token,
  ``outrider.interop.engines.kv_bytes_per_token``) and attend in the absorbed form, algebraically
  the same.
- ``mla_shapes(info)``: the head's MLA sizes for a target: the target's own for an MLA target
  (DeepSeek-V3, Kimi), otherwise derived from its head width.

Not done here: the absorbed (latent-cache) attention, MLA without ``q_lora_rank`` (SGLang's draft
refuses it), sliding windows (neither engine's MLA draft reads one).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb_interleave,
    yarn_apply_mscale,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from outrider.heads.attention import DraftAttention

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_shapes(info: Any) -> dict[str, int]:
    """The MLA sizes of a head for a target (``outrider.models.ArchInfo``).

    An MLA target gives its own (a target without ``q_lora_rank``, e.g. DeepSeek-V2-Lite, gets
    ``3 * kv_lora_rank``, Kimi's ratio). Otherwise, from the target's head width d: nope = v = d,
    rope = d/2, kv_lora_rank = 4d, q_lora_rank = min(12d, H) (Kimi-K2.5: d = 128 gives 512 and 1536).
    """
    if info.attention == "MLA" and info.kv_lora_rank:
        return {"q_lora_rank": info.q_lora_rank or 3 * info.kv_lora_rank, "kv_lora_rank": info.kv_lora_rank,
                "qk_nope_head_dim": info.qk_nope_head_dim, "qk_rope_head_dim": info.qk_rope_head_dim,
                "v_head_dim": info.v_head_dim or info.qk_nope_head_dim}
    d = info.head_dim
    return {"q_lora_rank": min(12 * d, info.hidden_size), "kv_lora_rank": 4 * d, "qk_nope_head_dim": d,
            "qk_rope_head_dim": max(2, d // 2 // 2 * 2), "v_head_dim": d}


def softmax_scale(config: Any) -> float:
    """``(nope + rope) ** -0.5``, times YaRN's ``mscale_all_dim`` factor squared."""
    return yarn_apply_mscale(config.rope_parameters(), (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)


class MLAAttention(DraftAttention):
    """MLA over the 2H-wide input of an EAGLE-3 layer; the cache sees per-head keys and values."""

    def __init__(self, config: Any):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads = self.num_kv_heads = config.num_attention_heads
        self.nope, self.rope, self.v_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.head_dim = self.nope + self.rope  # query/key width
        self.kv_lora_rank = config.kv_lora_rank
        self.scaling = softmax_scale(config)
        self.q_a_proj = nn.Linear(2 * H, config.q_lora_rank, bias=False)
        self.q_a_layernorm = LlamaRMSNorm(config.q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = LlamaRMSNorm(self.kv_lora_rank, eps=eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, H, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [B, heads, n, nope + rope] and v [B, heads, n, v_head_dim] of x [B, n, 2H];
        cos, sin: [B, n, rope]."""
        B, n, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, n, self.num_heads, self.head_dim).transpose(1, 2)  # [B, heads, n, nope + rope]
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, n, kv_lora_rank]
        k_rot = k_rot.view(B, 1, n, self.rope)  # one rope key shared by every head
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        kv = self.kv_b_proj(latent).view(B, n, self.num_heads, self.nope + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)  # [B, heads, n, nope], [B, heads, n, v]
        k = torch.cat([k_nope, k_rot.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return torch.cat([q_nope, q_rot], dim=-1), k, v.contiguous()
