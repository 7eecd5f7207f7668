"""The DFlash block drafter (z-lab, arXiv 2602.06036): config and module.

Contract (the layout vLLM's ``DFlashDraftModel`` and SpecForge's ``DFlashDraftModel`` read):
- **Context.** The target's aux states ``a_s`` (ids in outrider's meaning: id ``j`` = the state
  entering target layer ``j``; DFlash's ``target_layer_ids`` are ``j - 1``, the layer whose output
  it is) are fused and normalised once, ``c_s = hidden_norm(fc(a_s))`` (``fc``: n_aux*H_t -> H, no
  bias). Every draft layer ``l`` turns ``c_s`` into keys and values at position ``s`` with its own
  projections: ``K = rope(k_norm(k_proj(c_s)))``, ``V = v_proj(c_s)`` (no input norm). The context
  enters no layer's residual stream: it is only attended to.
- **Block.** A block of ``m`` positions ``p .. p+m-1`` holds the last committed token ``x_p``
  (whose state the target has not computed yet) and ``m - 1`` copies of ``mask_token_id``,
  embedded with the target's frozen embedding. Each draft layer is a Qwen3 decoder layer
  (pre-norm, per-head ``q_norm``/``k_norm`` RMSNorm before the rotary, SwiGLU MLP); its queries
  see the context keys of positions ``< p`` and every key of their own block (not causal). The
  output at block position ``i >= 1``, through ``norm`` and ``lm_head``, predicts ``x_{p+i}``:
  one forward drafts ``m - 1`` tokens.
- ``lm_head`` (H -> draft_vocab) and ``d2t``/``t2d`` are EAGLE-3's (``heads.eagle3``): draft ids
  map to target ids with ``i + d2t[i]``. ``block_size`` is the block the drafter was trained with:
  it drafts up to ``block_size - 1`` tokens per forward.
- State dict: ``fc.weight``, ``hidden_norm.weight``, ``layers.{l}.input_layernorm.weight``,
  ``layers.{l}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{l}.self_attn.{q,k}_norm.weight``,
  ``layers.{l}.post_attention_layernorm.weight``, ``layers.{l}.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight`` and the buffers ``d2t``, ``t2d``; the embedding is the target's.

Not done here: training (``outrider.train.loop.dflash_loss``), drafting with a cache
(``outrider.decode.proposers.dflash``), files (``outrider.interop.formats.dflash``), sliding windows,
attention biases, a separately trained mask embedding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from outrider.errors import UserError
from outrider.heads.eagle3 import (
    AUX_IDS_SEMANTICS,
    Eagle3Config,
    Eagle3Head,
    Rotary,
    required_field,
    rope_from_config,
    text_config,
)
from outrider.models import arch_info

DRAFTER = "dflash"  # the ``outrider.drafter`` a DFlash checkpoint records


@dataclass
class DFlashConfig:
    """Sizes of a DFlash drafter; ``for_target`` copies width, heads, MLP, norms and rope from the target."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # outrider's meaning (AUX_IDS_SEMANTICS)
    block_size: int  # positions per block: the committed token and block_size - 1 masks
    mask_token_id: int
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    num_target_layers: int = 0  # the target's decoder layers (recorded for engines and checks)

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(j) for j in self.aux_layer_ids)
        if not self.aux_layer_ids or len(set(self.aux_layer_ids)) != len(self.aux_layer_ids):
            raise UserError(f"a DFlash drafter needs distinct aux layer ids, got {list(self.aux_layer_ids)}")
        if min(self.aux_layer_ids) < 1:
            raise UserError("a DFlash drafter reads layer outputs: aux id 0 (the embedding) has no DFlash "
                            "target_layer_id")
        if type(self.block_size) is not int or self.block_size < 2:
            raise UserError(f"block_size must be an integer >= 2 (one committed token and at least one mask), "
                            f"got {self.block_size!r}")
        if type(self.num_hidden_layers) is not int or self.num_hidden_layers < 1:
            raise UserError(f"a DFlash drafter needs at least one layer, got {self.num_hidden_layers!r}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise UserError(f"draft vocabulary size {self.draft_vocab_size} must be in 1..{self.vocab_size}")
        if not (type(self.mask_token_id) is int and 0 <= self.mask_token_id < self.vocab_size):
            raise UserError(f"mask_token_id must be a token id in 0..{self.vocab_size - 1}, got {self.mask_token_id!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")

    @property
    def max_draft(self) -> int:
        """Draft tokens one forward gives: the block's masks."""
        return self.block_size - 1

    @property
    def target_layer_ids(self) -> list[int]:
        """The aux ids in DFlash's meaning (the target layer whose output is read): ours minus one."""
        return [j - 1 for j in self.aux_layer_ids]

    @classmethod
    def for_target(cls, target_config: Any, draft_vocab_size: int, mask_token_id: int, block_size: int = 8,
                   num_layers: int = 1, aux_layer_ids: Sequence[int] | None = None,
                   num_kv_heads: int | None = None) -> "DFlashConfig":
        """A drafter as wide as the target with ``num_layers`` Qwen3 layers (the target's head layout;
        on an MLA target plain multi-head attention of ``H / heads``). ``num_kv_heads`` replaces the
        target's key/value heads (a divisor of its heads; the heads themselves: plain multi-head, whose
        values carry ``H`` dims of context per layer where the target's GQA layout carries
        ``kv * head_dim``). Aux ids default to EAGLE-3's ``(2, L//2, L-3)``; ``L`` (the last layer's
        output) is allowed."""
        cfg = target_config if isinstance(target_config, dict) else target_config.to_dict()
        info = arch_info(cfg)
        ids = tuple(int(j) for j in (aux_layer_ids if aux_layer_ids is not None else info.default_aux_layer_ids()))
        bad = [j for j in ids if not 1 <= j <= info.num_layers]
        if bad:
            raise UserError(f"aux layer ids {bad} out of range for a DFlash drafter: ids 1..{info.num_layers} "
                            f"(the target has {info.num_layers} layers)")
        if num_kv_heads is not None and (type(num_kv_heads) is not int or num_kv_heads < 1
                                         or info.num_heads % num_kv_heads):
            raise UserError(f"a DFlash drafter's own key/value heads (dflash_kv_heads {num_kv_heads!r}) must divide "
                            f"its {info.num_heads} attention heads (the target's)")
        text = text_config(cfg)
        rope_theta, rope_scaling = rope_from_config(text)
        mla = info.attention == "MLA"
        return cls(
            hidden_size=info.hidden_size, num_hidden_layers=int(num_layers), num_attention_heads=info.num_heads,
            num_key_value_heads=num_kv_heads or (info.num_heads if mla else info.num_kv_heads),
            head_dim=info.hidden_size // info.num_heads if mla else info.head_dim,
            intermediate_size=info.intermediate_size or math.ceil(8 * info.hidden_size / 3 / 64) * 64,
            rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6), rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=info.max_position_embeddings or 4096, vocab_size=info.vocab_size,
            draft_vocab_size=int(draft_vocab_size), target_hidden_size=info.hidden_size, aux_layer_ids=ids,
            block_size=int(block_size), mask_token_id=int(mask_token_id), num_target_layers=info.num_layers)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        d["aux_layer_ids_semantics"] = AUX_IDS_SEMANTICS
        d["drafter"] = DRAFTER
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in d and required_field(f)]
        if missing:
            raise UserError(f"DFlash drafter config lacks {', '.join(missing)}: not a config written by outrider")
        if d.get("aux_layer_ids_semantics", AUX_IDS_SEMANTICS) != AUX_IDS_SEMANTICS:
            raise UserError(f"DFlash drafter config records aux ids as '{d['aux_layer_ids_semantics']}', "
                            f"outrider expects '{AUX_IDS_SEMANTICS}'")
        return cls(**{k: v for k, v in d.items() if k in names})

    rope_parameters = Eagle3Config.rope_parameters  # the same rope fields, the same form

    def llama_config(self) -> LlamaConfig:
        """The sizes as a ``LlamaConfig`` (rotary and MLP building blocks)."""
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope_parameters(), tie_word_embeddings=False)


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys are the context's (given) then the block's own."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k [B, kv, n, d] (normed, rotated) and v [B, kv, n, d] of x [B, n, H]."""
        B, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # x: [B, m, H] (normed); ctx_k, ctx_v: [B, kv, S, d]; mask: [B, 1, m, S + m] bool (True = may attend)
        B, m, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, m, self.num_heads, self.head_dim)).transpose(1, 2)  # [B, h, m, d]
        q = _rotate(q, cos, sin)
        k, v = self.keys(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # [B, kv, S + m, d]
        g = self.num_heads // self.num_kv_heads
        if g > 1:
            k = k[:, :, None].expand(-1, -1, g, -1, -1).flatten(1, 2)  # [B, h, S + m, d]
            v = v[:, :, None].expand(-1, -1, g, -1, -1).flatten(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, m, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, m, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, n, d]; cos, sin: [B, n, d]
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(config.llama_config())

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # h: [B, m, H] -> [B, m, H]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """``context_kv`` turns aux states into every layer's keys and values; ``block`` runs a block."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        H, n_aux = config.hidden_size, len(config.aux_layer_ids)
        self.fc = nn.Linear(n_aux * config.target_hidden_size, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary = Rotary(config)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # [draft_vocab]
        self.register_buffer("t2d", t2d)  # [vocab]
        self.reset_parameters()

    # the draft vocabulary works as an EAGLE-3 head's
    set_vocab = Eagle3Head.set_vocab
    map_to_target = Eagle3Head.map_to_target

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
            elif isinstance(module, LlamaRMSNorm):
                nn.init.ones_(module.weight)

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """aux [B, S, n_aux * H_t] at positions [B, S] -> per layer (k, v), each [B, kv, S, d]."""
        c = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))  # [B, S, H]
        cos, sin = self.rotary(positions, c.dtype)
        return [layer.self_attn.keys(c, cos, sin) for layer in self.layers]

    def block(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: Sequence[tuple[torch.Tensor, torch.Tensor]],
              mask: torch.Tensor) -> torch.Tensor:
        """The block's hidden states [B, m, H] (before ``norm``).

        embeds: [B, m, H] the target's embedding of the block tokens; positions: [B, m];
        ctx: per layer (k, v) [B, kv, S, d]; mask: [B, 1, m, S + m] bool over [context | block] keys.
        """
        cos, sin = self.rotary(positions, embeds.dtype)
        h = embeds.to(self.fc.weight.dtype) if not torch.is_autocast_enabled(embeds.device.type) else embeds
        for layer, (k, v) in zip(self.layers, ctx):
            h = layer(h, cos, sin, k, v, mask)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        # h: [..., H] -> draft logits [..., draft_vocab]
        return self.lm_head(self.norm(h))
