"""The EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840): config and module.

Contract (DESIGN.md, "EAGLE-3 head and export contract"):
- ``fc`` Linear(3*H_t -> H, no bias) fuses the three aux hidden states of the target
  (``fuse``). Aux id ``j`` is the hidden state *entering* target decoder layer ``j``
  (Hugging Face ``output_hidden_states[j]``); ``j = L`` is the last layer's output before the
  final norm. EAGLE 3.1 options normalise the aux states first: ``fc_norm`` one RMSNorm per
  aux chunk (``fc_norm.{i}``), ``norm_before_fc`` one over their concatenation (``input_norm``).
- ``midlayer`` is one decoder layer whose attention reads ``[input_layernorm(e); hidden_norm(h)]``
  (width 2H), where ``e`` is the target's (frozen) embedding of the input token and ``h`` the
  hidden input; the residual runs on ``h`` (on ``hidden_norm(h)`` with ``norm_before_residual``).
  The attention is GQA (Llama, ``outrider.heads.attention``) or MLA (``attention="mla"``,
  ``outrider.heads.mla``), with a dense SwiGLU MLP either way. ``h`` is the fused target feature
  at the first draft step and the head's own ``hidden_out`` afterwards: the pre-norm output
  ``h + attn + mlp(...)``, or its ``norm`` with ``norm_output``.
- ``norm`` (unless already applied) then ``lm_head`` Linear(H -> draft_vocab, no bias) give the
  draft logits. ``map_to_target`` turns draft ids into target ids with ``d2t`` (``i + d2t[i]``).
- The state dict holds ``fc.weight`` (and the 3.1 norms), ``midlayer.*`` (norms, attention
  projections, ``mlp.{gate,up,down}_proj``), ``norm.weight``, ``lm_head.weight`` and the buffers
  ``d2t`` (int64 [draft_vocab]) and ``t2d`` (bool [vocab]). The embedding is the target's and is
  never part of it: callers embed the tokens (``bind_embedding`` keeps an unregistered reference).
- With a ``cache`` (anything with ``update(k, v, 0)``, e.g. the proposer's ``HeadCache``) the head
  writes its new keys/values through it and attends over what it returns; the caller passes the
  mask. ``sliding_window`` W > 0 (GQA heads only): a query sees the last W positions.
- Rotary embedding with the target's rope settings (``rope_theta`` and the scaling dict); GQA heads
  rotate halves (Llama), MLA heads interleaved pairs of their rope slice; the frequencies stay
  float32 whatever dtype the head is cast to.

Not done here: drafting loops and trees (``outrider.decode.proposers``), training
(``outrider.train``), checkpoint formats (``outrider.interop.formats``), dynamic-NTK or longrope
switching at run time (the frequencies are computed once from the scaling dict).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Sequence

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from outrider.errors import UserError
from outrider.heads.attention import GQAAttention, window_mask
from outrider.heads.mla import MLA_FIELDS, MLAAttention, mla_shapes
from outrider.models import arch_info

AUX_IDS_SEMANTICS = "id j = hidden state entering target decoder layer j = HF output_hidden_states[j]"
ATTENTIONS = ("gqa", "mla")
OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "sliding_window",  # EAGLE 3.1 & co
           "parallel_drafting", "mask_token_id")  # P-EAGLE
_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")


@dataclass
class Eagle3Config:
    """Sizes of an EAGLE-3 head; ``for_target`` copies them from the target's config.

    ``attention="mla"``: ``head_dim`` is the query/key width ``qk_nope_head_dim + qk_rope_head_dim``
    and ``num_key_value_heads`` the number of heads (keys and values are per head once expanded).
    """

    hidden_size: int
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
    aux_layer_ids: tuple[int, ...]
    rope_scaling: dict[str, Any] | None = None  # the target's, with "rope_type"; None = plain RoPE
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    attention: str = "gqa"  # "gqa" (Llama) | "mla" (DeepSeek-V2/V3 latent attention)
    q_lora_rank: int = 0  # MLA sizes (0 for GQA heads)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    norm_before_residual: bool = False  # the residual is hidden_norm(h), not h
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states ("input_norm")
    fc_norm: bool = False  # one RMSNorm per aux state, each with its own weight ("fc_norm.{i}")
    norm_output: bool = False  # hidden_out (fed back to the next step) is the normed output
    sliding_window: int = 0  # > 0: a query sees the last this many positions (GQA only)
    # P-EAGLE: all k drafts in one forward; positions after the first hold the token ``mask_token_id``
    # and the learned aux state ``mask_hidden`` [1, n_aux * H_t] (fused by ``fc`` as a real one)
    parallel_drafting: bool = False
    mask_token_id: int = -1

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(j) for j in self.aux_layer_ids)
        if len(self.aux_layer_ids) != 3:
            raise UserError(f"an EAGLE-3 head fuses exactly 3 aux layers, got ids {list(self.aux_layer_ids)}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise UserError(f"draft vocabulary size {self.draft_vocab_size} must be in 1..{self.vocab_size} "
                            "(the target's vocabulary)")
        if self.attention not in ATTENTIONS:
            raise UserError(f"head attention '{self.attention}' is not one of {', '.join(ATTENTIONS)}")
        if self.attention == "mla":
            bad = [k for k in MLA_FIELDS if not int(getattr(self, k)) > 0]
            if bad:
                raise UserError(f"an MLA head needs positive {', '.join(bad)} (SGLang refuses an MLA draft "
                                "without q_lora_rank)")
            if self.qk_rope_head_dim % 2:
                raise UserError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (rotary pairs)")
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            self.num_key_value_heads = self.num_attention_heads
            if self.sliding_window:
                raise UserError("a sliding window is served for GQA heads only: neither vLLM's nor SGLang's MLA "
                                "draft reads one")
            if self.norm_before_fc:
                raise UserError("norm_before_fc (input_norm) is read by no engine's MLA draft: use fc_norm")
        elif self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.norm_before_fc and self.fc_norm:
            raise UserError("norm_before_fc and fc_norm exclude each other (as in speculators): choose one")
        if isinstance(self.sliding_window, bool) or int(self.sliding_window) < 0:
            raise UserError(f"sliding_window must be an integer >= 0 (0 = full attention), got {self.sliding_window!r}")
        self.sliding_window = int(self.sliding_window)
        if not isinstance(self.parallel_drafting, bool):
            raise UserError(f"parallel_drafting must be true or false, got {self.parallel_drafting!r}")
        if self.parallel_drafting and not (type(self.mask_token_id) is int and 0 <= self.mask_token_id < self.vocab_size):
            raise UserError(f"a parallel-drafting head needs mask_token_id in 0..{self.vocab_size - 1} (the placeholder "
                            f"token), got {self.mask_token_id!r}")
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)

    @classmethod
    def for_target(cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: Sequence[int] | None = None,
                   attention: str = "gqa", **options: Any) -> "Eagle3Config":
        """A head sized like the target (a ``PretrainedConfig`` or a config.json dict).

        Width, heads, MLP size, norm eps, rope and positions are the target's. GQA heads (the
        default) take the target's head layout; on an MLA target (DeepSeek-V3, Kimi) plain
        multi-head attention with ``head_dim = H / heads``. MLA heads (``attention="mla"``) take
        the target's MLA sizes when it has them (``mla_shapes``). ``options``: EAGLE 3.1 switches
        (``OPTIONS``) and MLA sizes overriding the defaults. Aux ids default to ``(2, L//2, L-3)``;
        ``L`` (the last layer's output) is allowed.
        """
        cfg = target_config if isinstance(target_config, dict) else target_config.to_dict()
        info = arch_info(cfg)
        if aux_layer_ids is None:
            aux_layer_ids = info.default_aux_layer_ids()
        bad = [j for j in aux_layer_ids if not 0 <= int(j) <= info.num_layers]
        if bad:
            raise UserError(f"aux layer ids {bad} out of range: the target has {info.num_layers} layers "
                            f"(ids 0..{info.num_layers}, {info.num_layers} = the last layer's output)")
        unknown = sorted(set(options) - set(OPTIONS) - set(MLA_FIELDS))
        if unknown:
            raise UserError(f"unknown head option(s) {', '.join(unknown)}: use {', '.join(OPTIONS + MLA_FIELDS)}")
        text = text_config(cfg)
        rope_theta, rope_scaling = rope_from_config(text)
        mla = info.attention == "MLA"
        intermediate = info.intermediate_size or math.ceil(8 * info.hidden_size / 3 / 64) * 64  # SwiGLU 8H/3
        extra: dict[str, Any] = {}
        if attention == "mla":
            extra = {**mla_shapes(info), **{k: int(v) for k, v in options.items() if k in MLA_FIELDS}}
        elif any(k in MLA_FIELDS for k in options):
            raise UserError("MLA sizes given for a GQA head: pass attention='mla' (train: head_attention 'mla')")
        return cls(
            hidden_size=info.hidden_size,
            num_attention_heads=info.num_heads,
            num_key_value_heads=info.num_heads if mla else info.num_kv_heads,
            head_dim=info.hidden_size // info.num_heads if mla else info.head_dim,
            intermediate_size=intermediate,
            rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=info.max_position_embeddings or 4096,
            vocab_size=info.vocab_size,
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=info.hidden_size,
            aux_layer_ids=tuple(int(j) for j in aux_layer_ids),
            attention=attention,
            **extra,
            **{k: v for k, v in options.items() if k in OPTIONS},
        )

    @classmethod
    def unchecked(cls, **values: Any) -> "Eagle3Config":
        """The sizes as a checkpoint's config states them, not validated (a head that outrider cannot
        build can still be described); ``dataclasses.replace`` of it validates."""
        cfg = object.__new__(cls)
        for f in fields(cls):
            setattr(cfg, f.name, values[f.name] if f.name in values else None if required_field(f) else f.default)
        return cfg

    @property
    def value_dim(self) -> int:
        """Width of one head's value (and of its attention output)."""
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.parallel_drafting:  # an EAGLE-3 head's config stays as it was
            del d["parallel_drafting"], d["mask_token_id"]
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        d["aux_layer_ids_semantics"] = AUX_IDS_SEMANTICS
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Eagle3Config":
        """Inverse of ``to_dict``; unknown keys are ignored, missing required ones are a ``UserError``."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        missing = [f.name for f in fields(cls) if f.name not in kwargs and required_field(f)]
        if missing:
            raise UserError(f"EAGLE-3 head config lacks {', '.join(missing)}: not a config written by outrider")
        semantics = d.get("aux_layer_ids_semantics")
        if semantics is not None and semantics != AUX_IDS_SEMANTICS:
            raise UserError(f"EAGLE-3 head config records aux ids as '{semantics}', "
                            f"outrider expects '{AUX_IDS_SEMANTICS}'")
        return cls(**kwargs)

    def rope_parameters(self) -> dict[str, Any]:
        """The rope settings in ``transformers``' ``rope_parameters`` form."""
        params = dict(self.rope_scaling or {"rope_type": "default"})
        params["rope_theta"] = self.rope_theta
        return params

    def llama_config(self) -> LlamaConfig:
        """A ``LlamaConfig`` with the head's sizes (for the rotary and MLP building blocks; its
        ``head_dim`` is the rotary width: the rope slice of an MLA head)."""
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.qk_rope_head_dim if self.attention == "mla" else self.head_dim, hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope_parameters(), tie_word_embeddings=False,
        )


def required_field(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    for key in _TEXT_CONFIG_KEYS:
        inner = cfg.get(key)
        if isinstance(inner, dict) and inner.get("hidden_size"):
            return inner
    return cfg


def _normalise_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    if out["rope_type"] == "default" and len(out) == 1:
        return None
    if out["rope_type"] not in ROPE_INIT_FUNCTIONS and out["rope_type"] != "default":
        raise UserError(f"rope type '{out['rope_type']}' is not supported by transformers' RoPE functions")
    return out


def rope_from_config(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a raw config.json or a transformers>=5 dict."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), _normalise_rope_scaling(params)
    return float(cfg.get("rope_theta") or 10000.0), _normalise_rope_scaling(cfg.get("rope_scaling"))


class Rotary(nn.Module):
    """cos/sin tables for positions; ``inv_freq`` stays float32 when the module is cast."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        llama = config.llama_config()
        rope_type = llama.rope_parameters["rope_type"]
        init = (LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default"
                else ROPE_INIT_FUNCTIONS[rope_type])
        inv_freq, self.attention_scaling = init(llama)
        self._inv_freq32 = inv_freq.float()
        self.register_buffer("inv_freq", self._inv_freq32.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq32.to(self.inv_freq.device)  # undo any dtype cast
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [batch, n] -> cos, sin: [batch, n, rotary width]
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def make_attention(config: Eagle3Config) -> nn.Module:
    """The layer's attention module for ``config.attention``."""
    return MLAAttention(config) if config.attention == "mla" else GQAAttention(config)


class Eagle3DecoderLayer(nn.Module):
    """The single decoder layer: attention over [input_layernorm(e); hidden_norm(h)], residual on h."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.self_attn = make_attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(config.llama_config())

    def forward(self, input_embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any | None) -> torch.Tensor:
        # input_embeds, hidden: [batch, n, H] -> [batch, n, H] (pre-norm)
        q, k, v = self.before_attention(input_embeds, hidden, cos, sin)
        return self.after_attention(hidden, self.self_attn.attend(q, k, v, attention_mask, cache))

    def before_attention(self, input_embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(input_embeds), self.hidden_norm(hidden)], dim=-1)  # [B, n, 2H]
        return self.self_attn.project(x, cos, sin)

    def after_attention(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        # hidden: [B, n, H]; attended: [B, n, heads * d_v] -> [B, n, H] (pre-norm)
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        h = residual + self.self_attn.o_proj(attended)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """EAGLE-3 head: ``fuse`` the aux states, then ``forward`` one draft step over n tokens."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        H, Ht, eps = config.hidden_size, config.target_hidden_size, config.rms_norm_eps
        n_aux = len(config.aux_layer_ids)
        self.input_norm = LlamaRMSNorm(n_aux * Ht, eps=eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(Ht, eps=eps) for _ in range(n_aux)) if config.fc_norm else None
        self.fc = nn.Linear(n_aux * Ht, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(H, eps=eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        # P-EAGLE's placeholder aux state (vLLM: ``mask_hidden``, fused through fc like a real one)
        self.mask_hidden = nn.Parameter(torch.zeros(1, n_aux * Ht)) if config.parallel_drafting else None
        self.rotary = Rotary(config)  # no persistent state
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # [draft_vocab]
        self.register_buffer("t2d", t2d)  # [vocab]
        self._embedding: tuple[nn.Module, ...] = ()  # the target's, unregistered on purpose
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
            elif isinstance(module, LlamaRMSNorm):
                nn.init.ones_(module.weight)
        if self.mask_hidden is not None:  # on the scale of a real aux state (unit RMS after the target's norms)
            nn.init.normal_(self.mask_hidden, std=1.0)

    @property
    def attention_scale(self) -> float | None:
        """The softmax scale of the head's attention (None: ``head_dim ** -0.5``)."""
        return self.midlayer.self_attn.scaling

    # --- vocabulary -----------------------------------------------------------------------

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary: d2t int64 [draft_vocab] offsets, t2d bool [vocab]."""
        cfg = self.config
        if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.vocab_size,):
            raise UserError(f"draft vocabulary of shape d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} does not fit "
                            f"this head (draft {cfg.draft_vocab_size}, target {cfg.vocab_size})")
        target_ids = torch.arange(cfg.draft_vocab_size, device=d2t.device) + d2t.long()
        if cfg.draft_vocab_size and (int(target_ids.min()) < 0 or int(target_ids.max()) >= cfg.vocab_size):
            raise UserError(f"d2t maps draft ids outside the target vocabulary 0..{cfg.vocab_size - 1}")
        if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d.bool()[target_ids.to(t2d.device)].all()):
            raise UserError("d2t and t2d disagree: every draft id must map to a target id marked in t2d")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape) -> target ids: ``i + d2t[i]``."""
        return draft_ids + self.d2t[draft_ids]

    # --- embedding (the target's, never part of the state dict) ---------------------------

    def bind_embedding(self, embedding: nn.Module) -> None:
        """Keep a reference to the target's frozen input embedding for ``embed``."""
        self._embedding = (embedding,)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [batch, n] target ids -> [batch, n, H]
        if not self._embedding:
            raise RuntimeError("no embedding bound: call bind_embedding(target.get_input_embeddings()) first")
        with torch.no_grad():
            return self._embedding[0](input_ids)

    # --- compute --------------------------------------------------------------------------

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        # aux: [batch, n, 3*H_t] (ids in config order) -> [batch, n, H]
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)  # 3 x [batch, n, H_t]
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def placeholder(self, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE's inputs at n placeholder positions per row: (token ids [batch, n] of
        ``mask_token_id``, hidden [batch, n, H] = fc(mask_hidden))."""
        if self.mask_hidden is None:
            raise RuntimeError("not a parallel-drafting head (no mask_hidden)")
        hidden = self.fuse(self.mask_hidden.to(self.fc.weight.dtype)[None])  # [1, 1, H]
        ids = torch.full((batch, n), self.config.mask_token_id, dtype=torch.long, device=hidden.device)
        return ids, hidden.expand(batch, n, -1)

    def forward_hidden(self, input_embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None = None, cache: Any | None = None) -> torch.Tensor:
        """One draft step without the logits: returns ``hidden_out`` [batch, n, H]."""
        # input_embeds, hidden: [batch, n, H]; position_ids: [batch, n]
        # attention_mask: [batch, 1, n, S] additive float or bool (True = may attend); None = causal
        # (windowed by position when the head has a sliding window and no cache)
        if attention_mask is None and self.config.sliding_window:
            if cache is not None:
                raise ValueError("a sliding-window head over a cache needs the caller's mask (HeadCache.mask)")
            attention_mask = window_mask(position_ids, position_ids, self.config.sliding_window)[:, None]
        q, k, v = self.before_attention(input_embeds, hidden, position_ids)
        return self.after_attention(hidden, self.attend(q, k, v, attention_mask, cache))

    # one draft step in two parts around the attention (training runs them compiled, the attention eager)

    def before_attention(self, input_embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, n, d], k [B, kv, n, d], v [B, kv, n, d_v] of one step: norms, projections, rotary."""
        cos, sin = self.rotary(position_ids, hidden.dtype)
        return self.midlayer.before_attention(input_embeds, hidden, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
               cache: Any | None) -> torch.Tensor:
        """The step's attention -> [B, n, heads * d_v] (``forward_hidden``'s mask and cache conventions)."""
        return self.midlayer.self_attn.attend(q, k, v, attention_mask, cache)

    def after_attention(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """hidden_out [B, n, H] from the step's hidden input and its attention output."""
        out = self.midlayer.after_attention(hidden, attended)  # [B, n, H] pre-norm
        return self.norm(out) if self.config.norm_output else out

    def compute_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        # hidden_out: [..., H] -> draft logits [..., draft_vocab]
        return self.lm_head(hidden_out if self.config.norm_output else self.norm(hidden_out))

    def forward(self, input_embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: Any | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over n tokens -> (logits [batch, n, draft_vocab], hidden_out [batch, n, H])."""
        hidden_out = self.forward_hidden(input_embeds, hidden, position_ids, attention_mask, cache)
        return self.compute_logits(hidden_out), hidden_out
