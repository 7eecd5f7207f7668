"""Step-time model for speculative decoding: what a target forward, a draft round and a
verify step cost on given hardware, and the speedup they predict.

Contract:
- ``step_cost(shape, hw, tp, new_tokens, batch, context)`` is the time of one target forward
  over ``new_tokens`` (n) new tokens for each of ``batch`` (b) sequences that already hold
  ``context`` (c) tokens, on one tensor-parallel group of ``tp`` GPUs. It is a sum of named
  ``Term``s, each a roofline ``max(bytes / (bandwidth * eff), flops / (peak * eff))`` per GPU:
  attention weights, dense-MLP weights, shared-expert weights, routed-expert weights (only the
  distinct experts the n*b tokens wake), lm_head, KV or MLA-latent cache, plus the AllReduces
  of tensor parallelism (latency + ring bytes over the link) and a fixed per-step overhead.
- Weight precision is bytes per parameter *including* group scales (``WEIGHT_FORMATS``);
  routed experts and everything else may differ (Kimi-K2.5: INT4 experts, BF16 elsewhere).
- Hardware profiles are data (``outrider/hardware/*.json`` or a user file); ``load_profile``
  rejects a malformed one with a one-line ``UserError``.
- ``calibrate`` fits the efficiency and overhead terms to *measured step times* only
  (autoregressive and verify steps, optionally draft rounds), never to measured speedups;
  ``calibrate_measured`` takes a profiling session's numbers (single-stream tokens/s, share of
  decode time in AllReduce, collectives per token) instead.
- ``predict`` turns step costs and an ``Acceptance`` into tokens/s and speedup for one
  method, k (draft tokens per round) and batch size.

Units are in the names: ``_s`` seconds, ``_bytes``, ``_flops``, ``_per_s``.

Deliberately not modelled: prefill, tree drafts, expert parallelism and its all-to-all
(tensor parallelism only), load imbalance between GPUs, kernel-level efficiency differences
between matmul shapes, overlap of communication with compute, memory capacity limits on the
batch (a note is raised when the weights do not fit, nothing more).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from outrider.errors import UserError
from outrider.models import ArchInfo

ACT_BYTES = 2  # activations, KV cache and AllReduce messages are bf16
DEFAULT_DRAFT_VOCAB = 32000  # EAGLE-3 heads' usual reduced draft vocabulary


# --------------------------------------------------------------------------------------------
# Weight formats
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFormat:
    """A weight storage format: bytes per parameter including its scales, and the matmul path."""

    name: str
    bytes_per_param: float
    compute: str  # "bf16" (weights widened to bf16 in the kernel) or "fp8" (fp8 tensor cores)


# INT4: 4 bits + one bf16 scale per group of g weights = 0.5 + 2/g bytes.
# FP8 (DeepSeek-V3 style): 1 byte + one fp32 scale per 128x128 block = 1 + 4/16384 bytes.
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 2.0, "bf16"),
    "fp16": WeightFormat("fp16", 2.0, "bf16"),
    "fp8": WeightFormat("fp8", 1.0 + 4.0 / (128 * 128), "fp8"),
    "int8": WeightFormat("int8", 1.0 + 2.0 / 128, "bf16"),
    "int4": WeightFormat("int4", 0.5 + 2.0 / 128, "bf16"),
    "int4-g128": WeightFormat("int4-g128", 0.5 + 2.0 / 128, "bf16"),
    "int4-g32": WeightFormat("int4-g32", 0.5 + 2.0 / 32, "bf16"),
}


def weight_format(name: str) -> WeightFormat:
    key = name.strip().lower().replace("bfloat16", "bf16").replace("float16", "fp16")
    if key not in WEIGHT_FORMATS:
        raise UserError(f"unknown weight dtype '{name}': use one of {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[key]


@dataclass(frozen=True)
class Precision:
    """Storage of the routed experts and of every other weight (attention, dense, shared, lm_head)."""

    experts: WeightFormat
    other: WeightFormat

    @property
    def label(self) -> str:
        if self.experts == self.other:
            return self.other.name
        return f"{self.experts.name} experts / {self.other.name} other"


def parse_precision(spec: str) -> Precision:
    """``"fp8"`` sets every weight; ``"int4-g32/bf16"`` sets routed experts / everything else."""
    parts = [p for p in spec.split("/") if p.strip()]
    if len(parts) == 1:
        fmt = weight_format(parts[0])
        return Precision(fmt, fmt)
    if len(parts) == 2:
        return Precision(weight_format(parts[0]), weight_format(parts[1]))
    raise UserError(f"bad weight dtype '{spec}': give one dtype (e.g. bf16) or experts/other (e.g. int4-g32/bf16)")


def default_precision(arch: ArchInfo) -> Precision:
    """Guess the served precision from a config: quantised 4-bit MoE -> INT4 experts only."""
    q = arch.quantization.lower()
    bf16 = WEIGHT_FORMATS["bf16"]
    if "fp8" in q or "float8" in q:
        return Precision(WEIGHT_FORMATS["fp8"], WEIGHT_FORMATS["fp8"])
    if "int4" in q or "awq" in q or "gptq" in q:
        int4 = WEIGHT_FORMATS["int4"]
        return Precision(int4, bf16 if arch.is_moe else int4)
    return Precision(bf16, bf16)


# --------------------------------------------------------------------------------------------
# Hardware profiles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU model and how a serving engine uses it. Bandwidths and peaks are per GPU.

    ``memory_efficiency`` and ``compute_efficiency`` apply to the ceilings actually used: the
    measured ones where given, else the spec ones. ``link_bandwidth_bytes_per_s`` is per
    direction per GPU; ``link_latency_s`` is per ring hop (a ring AllReduce makes 2(tp-1) hops).
    ``step_overhead_s`` is paid once per target forward (scheduling, sampling, graph launch);
    ``layer_overhead_s`` once per decoder layer (+1 for embeddings/lm_head) of every forward,
    draft forwards included: the floor of small kernels that bandwidth alone does not explain.
    ``token_overhead_s`` is paid per new token of a target forward (n * b): host-side and
    elementwise work that grows with the tokens a step verifies (masks, sampling, acceptance).
    ``verify_overhead_s`` is paid once per verification step (n > 1): the host round trip that
    acceptance needs, which plain decoding avoids by running its steps back to back.
    """

    name: str
    description: str
    source: str
    memory_capacity_bytes: float
    memory_bandwidth_bytes_per_s: float
    bf16_flops_per_s: float
    interconnect: str  # "nvlink" | "pcie"
    link_bandwidth_bytes_per_s: float
    link_latency_s: float
    fp8_flops_per_s: float | None = None
    measured_memory_bandwidth_bytes_per_s: float | None = None
    measured_bf16_flops_per_s: float | None = None
    memory_efficiency: float = 0.85
    compute_efficiency: float = 0.7
    link_efficiency: float = 0.8
    step_overhead_s: float = 100e-6
    layer_overhead_s: float = 20e-6
    token_overhead_s: float = 0.0
    verify_overhead_s: float = 0.0
    collectives_per_layer: float = 2.0
    notes: str = ""

    @property
    def memory_ceiling_bytes_per_s(self) -> float:
        return self.measured_memory_bandwidth_bytes_per_s or self.memory_bandwidth_bytes_per_s

    def flops_ceiling_per_s(self, compute: str) -> float:
        """Matmul ceiling for ``"bf16"`` or ``"fp8"``; fp8 is scaled by the measured/spec bf16 ratio."""
        ratio = (self.measured_bf16_flops_per_s / self.bf16_flops_per_s) if self.measured_bf16_flops_per_s else 1.0
        if compute == "fp8" and self.fp8_flops_per_s:
            return self.fp8_flops_per_s * ratio
        return self.bf16_flops_per_s * ratio

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_REQUIRED = ("name", "memory_capacity_bytes", "memory_bandwidth_bytes_per_s", "bf16_flops_per_s",
             "interconnect", "link_bandwidth_bytes_per_s", "link_latency_s")
_FRACTIONS = ("memory_efficiency", "compute_efficiency", "link_efficiency")
_INTERCONNECTS = ("nvlink", "pcie")


def profile_from_dict(data: Any, origin: str = "hardware profile") -> HardwareProfile:
    """Validate a profile dict; every problem is a one-line ``UserError`` naming ``origin``."""
    if not isinstance(data, dict):
        raise UserError(f"{origin}: a hardware profile must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{origin}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(known))})")
    missing = [k for k in _REQUIRED if data.get(k) is None]
    if missing:
        raise UserError(f"{origin}: missing required key(s) {', '.join(missing)}")
    values: dict[str, Any] = {}
    for f in fields(HardwareProfile):
        if f.name not in data or data[f.name] is None:
            continue
        v = data[f.name]
        if f.name in ("name", "description", "source", "interconnect", "notes"):
            if not isinstance(v, str):
                raise UserError(f"{origin}: '{f.name}' must be a string")
            values[f.name] = v
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UserError(f"{origin}: '{f.name}' must be a number, got {v!r}")
        v = float(v)
        if f.name in _FRACTIONS and not 0 < v <= 1:
            raise UserError(f"{origin}: '{f.name}' must be in (0, 1], got {v}")
        if f.name in ("step_overhead_s", "layer_overhead_s", "token_overhead_s", "verify_overhead_s",
                      "link_latency_s"):
            if v < 0:
                raise UserError(f"{origin}: '{f.name}' must be >= 0, got {v}")
        elif v <= 0:
            raise UserError(f"{origin}: '{f.name}' must be > 0, got {v}")
        values[f.name] = v
    if values["interconnect"] not in _INTERCONNECTS:
        raise UserError(f"{origin}: 'interconnect' must be one of {', '.join(_INTERCONNECTS)}, got {values['interconnect']!r}")
    values.setdefault("description", values["name"])
    values.setdefault("source", "")
    return HardwareProfile(**values)


def builtin_profiles() -> list[str]:
    folder = resources.files("outrider") / "hardware"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name (``h200``, ``h100``, ``b200``, ``rtx-pro-6000``) or a JSON file."""
    spec = str(name_or_path)
    path = Path(spec).expanduser()
    if spec.endswith(".json") or path.exists():
        if not path.is_file():
            raise UserError(f"hardware profile not found: {path} (give a built-in name: {', '.join(builtin_profiles())})")
        text, origin = _read_text(path), str(path)
    else:
        key = spec.strip().lower()
        if key not in builtin_profiles():
            raise UserError(f"unknown hardware '{spec}': use one of {', '.join(builtin_profiles())} or a profile .json file")
        text, origin = (resources.files("outrider") / "hardware" / f"{key}.json").read_text(), f"built-in profile {key}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{origin} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return profile_from_dict(data, origin)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


# --------------------------------------------------------------------------------------------
# Model shape: parameter and byte counts from an ArchInfo
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the step model needs to know about a network, counted in parameters per layer."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # heads of the KV cache; 1 for MLA (one latent shared by all heads)
    attention: str
    attn_params: int  # per layer
    kv_elems_per_token: int  # cached elements per token per layer
    kv_replicated: bool  # MLA: every TP rank holds the whole latent cache
    attn_ctx_flops_per_pos: int  # per layer, per query token, per context position, all heads
    dense_layers: int
    dense_mlp_params: int  # per dense layer
    moe_layers: int
    num_experts: int
    experts_per_token: int
    expert_params: int  # one routed expert
    shared_params: int  # all shared experts of one MoE layer
    router_params: int  # per MoE layer
    lm_head_params: int
    precision: Precision
    routing_histogram: tuple[float, ...] | None = None  # tokens per expert, measured

    @classmethod
    def from_arch(cls, arch: ArchInfo, precision: Precision | None = None, name: str = "",
                  routing_histogram: Sequence[float] | None = None) -> "ModelShape":
        H, heads = arch.hidden_size, arch.num_heads
        if arch.attention == "MLA":
            qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
            v = arch.v_head_dim or arch.qk_nope_head_dim
            q = (H * arch.q_lora_rank + arch.q_lora_rank * heads * qk) if arch.q_lora_rank else H * heads * qk
            kv_a = H * (arch.kv_lora_rank + arch.qk_rope_head_dim)
            kv_b = arch.kv_lora_rank * heads * (arch.qk_nope_head_dim + v)
            attn = q + kv_a + kv_b + heads * v * H
            kv_elems = arch.kv_lora_rank + arch.qk_rope_head_dim
            # absorbed MLA decode: scores over (latent + rope), values over the latent
            ctx_flops = 2 * heads * (arch.kv_lora_rank + arch.qk_rope_head_dim) + 2 * heads * arch.kv_lora_rank
            kv_heads, replicated = 1, True
        else:
            hd, kv = arch.head_dim, arch.num_kv_heads
            attn = H * heads * hd + 2 * H * kv * hd + heads * hd * H
            kv_elems = 2 * kv * hd
            ctx_flops = 4 * heads * hd  # QK^T and PV, 2 flops per multiply-add
            kv_heads, replicated = kv, False
        moe = arch.is_moe
        expert_inter = (arch.moe_intermediate_size or arch.intermediate_size) if moe else 0
        return cls(
            name=name or arch.model_type,
            num_layers=arch.num_layers,
            hidden_size=H,
            num_heads=heads,
            num_kv_heads=kv_heads,
            attention=arch.attention,
            attn_params=attn,
            kv_elems_per_token=kv_elems,
            kv_replicated=replicated,
            attn_ctx_flops_per_pos=ctx_flops,
            dense_layers=arch.first_dense_layers if moe else arch.num_layers,
            dense_mlp_params=3 * H * arch.intermediate_size,  # gated MLP: gate, up, down
            moe_layers=arch.num_moe_layers,
            num_experts=arch.num_experts,
            experts_per_token=arch.experts_per_token,
            expert_params=3 * H * expert_inter,
            shared_params=arch.num_shared_experts * 3 * H * expert_inter,
            router_params=H * arch.num_experts,
            lm_head_params=arch.vocab_size * H,
            precision=precision or default_precision(arch),
            routing_histogram=tuple(float(x) for x in routing_histogram) if routing_histogram is not None else None,
        )

    @property
    def total_params(self) -> int:
        L = self.num_layers
        return (L * self.attn_params + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * (self.num_experts * self.expert_params + self.shared_params + self.router_params)
                + self.lm_head_params)

    @property
    def weight_bytes(self) -> float:
        experts = self.moe_layers * self.num_experts * self.expert_params
        other = self.total_params - experts
        return experts * self.precision.experts.bytes_per_param + other * self.precision.other.bytes_per_param


def expected_distinct_experts(num_experts: int, experts_per_token: int, tokens: float,
                              histogram: Sequence[float] | None = None) -> float:
    """Expected number of distinct routed experts woken in one layer by ``tokens`` tokens.

    Uniform routing: each token picks k of N experts, so an expert is missed by one token with
    probability 1 - k/N and by all m tokens with (1 - k/N)^m:  E = N (1 - (1 - k/N)^m).
    With a measured histogram h (tokens routed to each expert), expert e is picked by one token
    with p_e = k h_e / sum(h) and  E = sum_e 1 - (1 - p_e)^m  (tokens treated as independent).
    """
    if num_experts <= 0 or experts_per_token <= 0 or tokens <= 0:
        return 0.0
    if histogram is None:
        p = experts_per_token / num_experts
        return num_experts * (1.0 - (1.0 - p) ** tokens)
    total = float(sum(histogram))
    if total <= 0:
        raise UserError("routing histogram is empty: it must count tokens per expert")
    return sum(1.0 - (1.0 - min(1.0, experts_per_token * h / total)) ** tokens for h in histogram)


# --------------------------------------------------------------------------------------------
# Step cost
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One component of a step's time, per GPU."""

    name: str
    time_s: float
    bytes: float = 0.0
    flops: float = 0.0
    bound: str = "memory"  # "memory" | "compute" | "communication" | "overhead"
    compute: str = "bf16"  # matmul path of the flops: "bf16" | "fp8"


@dataclass(frozen=True)
class StepCost:
    """The time of one forward (or one draft round), as named terms."""

    terms: tuple[Term, ...]
    new_tokens: int
    batch: int
    context: int

    @property
    def total_s(self) -> float:
        return sum(t.time_s for t in self.terms)

    def term_s(self, name: str) -> float:
        return sum(t.time_s for t in self.terms if t.name == name)

    def shares(self) -> list[tuple[str, float]]:
        """(term, share of the total), largest first."""
        total = self.total_s or 1.0
        return sorted(((t.name, t.time_s / total) for t in self.terms), key=lambda x: -x[1])

    def dominant(self, top: int = 2) -> list[tuple[str, float]]:
        return [s for s in self.shares() if s[1] > 0][:top]

    def scaled(self, factor: float, prefix: str = "") -> "StepCost":
        terms = tuple(replace(t, name=prefix + t.name, time_s=t.time_s * factor, bytes=t.bytes * factor,
                              flops=t.flops * factor) for t in self.terms)
        return StepCost(terms, self.new_tokens, self.batch, self.context)


def _roofline(name: str, bytes_: float, flops: float, hw: HardwareProfile, compute: str = "bf16") -> Term:
    """max(bytes / (bandwidth * eff), flops / (peak * eff)): whichever resource is the bottleneck."""
    t_mem = bytes_ / (hw.memory_ceiling_bytes_per_s * hw.memory_efficiency)
    t_cmp = flops / (hw.flops_ceiling_per_s(compute) * hw.compute_efficiency)
    return Term(name, max(t_mem, t_cmp), bytes_, flops, "memory" if t_mem >= t_cmp else "compute", compute)


def allreduce_s(message_bytes: float, tp: int, hw: HardwareProfile) -> float:
    """One ring AllReduce over ``tp`` GPUs (Patarasuk & Yuan 2009; NCCL's ring).

    A ring makes 2(tp-1) hops (reduce-scatter then all-gather), each sending 1/tp of the
    message, so every GPU moves 2(tp-1)/tp * bytes over its link:
        t = 2(tp-1) * link_latency + 2(tp-1)/tp * bytes / (link_bandwidth * link_efficiency)
    """
    if tp <= 1:
        return 0.0
    hops = 2 * (tp - 1)
    return hops * hw.link_latency_s + hops / tp * message_bytes / (hw.link_bandwidth_bytes_per_s * hw.link_efficiency)


def forward_overhead_s(shape: ModelShape, hw: HardwareProfile, include_step: bool = True) -> float:
    """Fixed cost of one forward: per-step (target only) + per layer (+1 for embeddings/lm_head)."""
    return (hw.step_overhead_s if include_step else 0.0) + hw.layer_overhead_s * (shape.num_layers + 1)


def _check_step_args(tp: int, new_tokens: int, batch: int, context: int) -> None:
    if tp < 1 or new_tokens < 1 or batch < 1 or context < 0:
        raise UserError(f"step needs tp >= 1, new tokens >= 1, batch >= 1, context >= 0 (got tp={tp}, "
                        f"n={new_tokens}, b={batch}, c={context})")


def step_cost(shape: ModelShape, hw: HardwareProfile, tp: int = 1, new_tokens: int = 1, batch: int = 1,
              context: int = 2048, include_step_overhead: bool = True) -> StepCost:
    """One forward over n new tokens for each of b sequences holding c cached tokens, per GPU.

    Weights are sharded evenly over the tp GPUs (vocab-parallel lm_head, experts split by
    TP). Every dense weight is read once per step however many tokens it serves; a routed
    expert is read only if one of the m = n*b tokens picks it (``expected_distinct_experts``).
    FLOPs are 2 per multiply-add: 2 * params * tokens for matmuls.
    """
    _check_step_args(tp, new_tokens, batch, context)
    m = new_tokens * batch  # tokens in this forward
    p = shape.precision
    other_b, expert_b = p.other.bytes_per_param, p.experts.bytes_per_param
    L = shape.num_layers
    terms: list[Term] = []

    attn_params = L * shape.attn_params
    terms.append(_roofline("attention weights", attn_params * other_b / tp, 2 * attn_params * m / tp, hw, p.other.compute))
    if shape.dense_layers and shape.dense_mlp_params:
        dense = shape.dense_layers * shape.dense_mlp_params
        terms.append(_roofline("dense MLP weights", dense * other_b / tp, 2 * dense * m / tp, hw, p.other.compute))
    if shape.moe_layers:
        if shape.shared_params:
            shared = shape.moe_layers * shape.shared_params
            terms.append(_roofline("shared-expert weights", shared * other_b / tp, 2 * shared * m / tp, hw, p.other.compute))
        distinct = expected_distinct_experts(shape.num_experts, shape.experts_per_token, m, shape.routing_histogram)
        routed_bytes = shape.moe_layers * (distinct * shape.expert_params * expert_b + shape.router_params * other_b) / tp
        routed_flops = 2 * shape.moe_layers * (shape.experts_per_token * shape.expert_params + shape.router_params) * m / tp
        terms.append(_roofline("routed-expert weights", routed_bytes, routed_flops, hw, p.experts.compute))
    lm_head = shape.lm_head_params
    terms.append(_roofline("lm_head", lm_head * other_b / tp, 2 * lm_head * m / tp, hw, p.other.compute))

    # Attention reads the cache once per step for all n query tokens (flash-decoding style);
    # GQA caches are split by KV head over TP (replicated beyond the head count), MLA's latent is
    # replicated on every rank.
    kv_shards = 1 if shape.kv_replicated else min(tp, max(1, shape.num_kv_heads))
    ctx = context + new_tokens
    kv_bytes = batch * ctx * shape.kv_elems_per_token * ACT_BYTES * L / kv_shards
    kv_flops = m * ctx * shape.attn_ctx_flops_per_pos * L / min(tp, shape.num_heads)
    terms.append(_roofline("MLA latent cache" if shape.attention == "MLA" else "KV cache", kv_bytes, kv_flops, hw))

    if tp > 1:
        count = hw.collectives_per_layer * L
        msg = m * shape.hidden_size * ACT_BYTES
        terms.append(Term("AllReduce", count * allreduce_s(msg, tp, hw), bytes=count * msg, bound="communication"))
    terms.append(Term("fixed overhead", forward_overhead_s(shape, hw, include_step_overhead), bound="overhead"))
    if include_step_overhead and hw.token_overhead_s:
        terms.append(Term("per-token overhead", hw.token_overhead_s * m, bound="overhead"))
    if include_step_overhead and hw.verify_overhead_s and new_tokens > 1:
        terms.append(Term("acceptance round trip", hw.verify_overhead_s, bound="overhead"))
    return StepCost(tuple(terms), new_tokens, batch, context)


# --------------------------------------------------------------------------------------------
# Drafts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftSpec:
    """How a method proposes k tokens: ``ngram`` (free), ``eagle3`` (a head) or ``draft`` (an LM).

    ``measured_round_s`` maps k to a measured draft round (k proposals) in seconds and, where
    present, replaces the model for that k.
    """

    method: str
    shape: ModelShape | None = None
    fc_params: int = 0  # EAGLE-3: fc over the three aux states, once per round
    measured_round_s: Mapping[int, float] = field(default_factory=dict)


def eagle3_head_shape(target: ArchInfo, draft_vocab: int = DEFAULT_DRAFT_VOCAB,
                      precision: Precision | None = None) -> DraftSpec:
    """An EAGLE-3 head for ``target``: one Llama decoder layer of the target's width whose q/k/v
    read [embed; hidden] (2H wide), an fc 3H -> H run once per round, and an lm_head over the
    draft vocabulary. Heads keep 8 KV heads (or the target's, if fewer) and the target's MLP width.
    """
    H, heads = target.hidden_size, target.num_heads
    hd = (target.v_head_dim or target.qk_nope_head_dim) if target.attention == "MLA" else target.head_dim
    hd = hd or H // heads
    kv = min(8, target.num_kv_heads) if target.attention != "MLA" else 8
    attn = 2 * H * heads * hd + 2 * (2 * H) * kv * hd + heads * hd * H
    inter = target.intermediate_size or 4 * H
    bf16 = WEIGHT_FORMATS["bf16"]
    shape = ModelShape(
        name="eagle3 head", num_layers=1, hidden_size=H, num_heads=heads, num_kv_heads=kv, attention="GQA",
        attn_params=attn, kv_elems_per_token=2 * kv * hd, kv_replicated=False, attn_ctx_flops_per_pos=4 * heads * hd,
        dense_layers=1, dense_mlp_params=3 * H * inter, moe_layers=0, num_experts=0, experts_per_token=0,
        expert_params=0, shared_params=0, router_params=0, lm_head_params=draft_vocab * H,
        precision=precision or Precision(bf16, bf16),
    )
    return DraftSpec("eagle3", shape, fc_params=3 * H * H)


def draft_round_cost(draft: DraftSpec, hw: HardwareProfile, tp: int, k: int, batch: int, context: int) -> StepCost:
    """Cost of proposing k tokens for each of b sequences.

    n-gram: 0 (a lookup on the host, overlapped). EAGLE-3 head / draft model: k sequential
    forwards of one token per sequence, each with its per-layer overhead but no per-step one
    (they run inside the engine's step), plus, for EAGLE-3, one fc over the aux states.
    """
    if k in draft.measured_round_s:
        return StepCost((Term("draft (measured)", draft.measured_round_s[k], bound="overhead"),), k, batch, context)
    if draft.method == "ngram" or draft.shape is None:
        return StepCost((Term("draft (n-gram lookup)", 0.0, bound="overhead"),), k, batch, context)
    one = step_cost(draft.shape, hw, tp, 1, batch, context, include_step_overhead=False)
    cost = one.scaled(k, prefix="draft ")
    if draft.fc_params:
        fc = _roofline("draft fc", draft.fc_params * draft.shape.precision.other.bytes_per_param / tp,
                       2 * draft.fc_params * batch / tp, hw)
        cost = StepCost(cost.terms + (fc,), k, batch, context)
    return cost


# --------------------------------------------------------------------------------------------
# Acceptance and expected tokens
# --------------------------------------------------------------------------------------------


def expected_tokens_chain(rates: Sequence[float]) -> float:
    """Tokens per verify step for a chain of len(rates) drafts, bonus token included.

    With a_i the probability that draft i is accepted given drafts 1..i-1 were, draft i survives
    with prod_{j<=i} a_j, so E = 1 + sum_{i=1..k} prod_{j<=i} a_j.
    """
    total, survive = 1.0, 1.0
    for a in rates:
        survive *= a
        total += survive
    return total


def expected_tokens_alpha(alpha: float, k: int) -> float:
    """Leviathan et al. 2023 (arXiv 2211.17192), eq. 1: E = (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_from_tau(tau: float, k: int) -> float:
    """The alpha for which ``expected_tokens_alpha(alpha, k) == tau`` (bisection; E rises with alpha)."""
    if not 1.0 <= tau < k + 1:
        raise UserError(f"tau {tau} is impossible with k={k} draft tokens: it must be >= 1 and < {k + 1}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if expected_tokens_alpha(mid, k) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class Acceptance:
    """Per-position conditional acceptance rates a_1, a_2, ... (the last repeats beyond the list)."""

    rates: tuple[float, ...]
    source: str = ""

    def rates_for(self, k: int) -> tuple[float, ...]:
        if not self.rates:
            return (0.0,) * k
        return tuple(self.rates[i] if i < len(self.rates) else self.rates[-1] for i in range(k))

    def expected_tokens(self, k: int) -> float:
        return expected_tokens_chain(self.rates_for(k))

    @classmethod
    def from_alpha(cls, alpha: float, source: str = "") -> "Acceptance":
        if not 0.0 <= alpha < 1.0:
            raise UserError(f"alpha {alpha} is outside [0, 1): give the per-token acceptance probability")
        return cls((float(alpha),), source or f"alpha={alpha:g}")

    @classmethod
    def from_tau(cls, tau: float, k: int, source: str = "") -> "Acceptance":
        if tau < 1.0:
            raise UserError(f"tau {tau} < 1: tau counts tokens per target forward, bonus token included, so it is >= 1")
        alpha = alpha_from_tau(tau, k)
        return cls((alpha,), source or f"tau={tau:g} at k={k} (alpha={alpha:.3f})")

    @classmethod
    def from_rates(cls, rates: Sequence[float], source: str = "") -> "Acceptance":
        vals = tuple(float(a) for a in rates)
        if any(not 0.0 <= a <= 1.0 for a in vals):
            raise UserError(f"acceptance rates must lie in [0, 1], got {list(vals)}")
        return cls(vals, source)

    @classmethod
    def from_record(cls, record: Mapping[str, Any], origin: str = "bench record") -> "Acceptance":
        """From a bench record: ``accept_rate_per_pos`` (and ``tau`` to tell which kind), or ``tau`` and ``k``.

        Rates may be conditional (a_i = P(draft i accepted | 1..i-1 accepted)) or unconditional
        (u_i = P(at least i drafts accepted)); the one whose expected tokens match the record's
        ``tau`` is taken, conditional when there is no tau. Unconditional rates are converted
        with a_i = u_i / u_{i-1}. Rates per proposed draft (bench's) that give more tokens than the
        measured ``tau`` (steps without a proposal) get a first-position gate so that they give ``tau``.
        """
        method = record.get("method", "?")
        rates = record.get("accept_rate_per_pos")
        tau = record.get("tau")
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float))):
            raise UserError(f"{origin}: 'tau' of method {method} must be a number")
        if rates is None or (isinstance(rates, list) and not rates):
            k = record.get("k")
            if tau is None or not isinstance(k, int) or k < 1:
                raise UserError(f"{origin}: record for method {method} needs 'accept_rate_per_pos' (list) or 'tau' and 'k'")
            return cls.from_tau(float(tau), k, source=f"{origin}: tau={tau:g} at k={k}")
        if not isinstance(rates, list) or any(isinstance(a, bool) or not isinstance(a, (int, float)) for a in rates):
            raise UserError(f"{origin}: 'accept_rate_per_pos' of method {method} must be a list of numbers")
        rates_f = [float(a) for a in rates]
        if any(not 0.0 <= a <= 1.0 for a in rates_f):
            raise UserError(f"{origin}: 'accept_rate_per_pos' of method {method} must lie in [0, 1], got {rates_f}")
        conditional = rates_f
        if tau is not None:
            e_cond = expected_tokens_chain(rates_f)
            e_uncond = 1.0 + sum(rates_f)
            if abs(e_uncond - tau) < abs(e_cond - tau):
                conditional, prev = [], 1.0
                for u in rates_f:
                    conditional.append(min(1.0, u / prev) if prev > 0 else 0.0)
                    prev = u
        if tau is not None and conditional:
            # rates counted per *proposed* draft overstate a proposer that often proposes nothing
            # (n-gram without a match): a first-position gate g = P(a draft is proposed) restores the
            # measured tokens per step, 1 + g * (E - 1)
            e = expected_tokens_chain(conditional)
            if 1.0 <= float(tau) < e - 1e-6:
                conditional[0] *= (float(tau) - 1.0) / (e - 1.0)
        return cls(tuple(conditional), source=f"{origin}: {method} k={record.get('k', len(rates_f))}")


# --------------------------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """Predicted speed of one method at draft length k and batch size b."""

    method: str
    k: int
    batch: int
    expected_tokens: float  # per sequence per verify step, bonus included
    ar_step_s: float
    verify_step_s: float
    draft_round_s: float
    tokens_per_s: float  # all sequences together
    ar_tokens_per_s: float
    speedup: float
    verify_cost_ratio: float  # verify step over k+1 tokens / plain one-token step
    verify: StepCost
    draft: StepCost

    def dominant(self, top: int = 2) -> list[tuple[str, float]]:
        """Largest terms of the whole speculative step (draft round + verify)."""
        total = (self.verify_step_s + self.draft_round_s) or 1.0
        merged: dict[str, float] = {}
        for t in self.verify.terms + self.draft.terms:
            merged[t.name] = merged.get(t.name, 0.0) + t.time_s
        ranked = sorted(merged.items(), key=lambda x: -x[1])
        return [(n, s / total) for n, s in ranked if s > 0][:top]

    def to_row(self) -> dict[str, Any]:
        return {
            "method": self.method, "k": self.k, "batch": self.batch,
            "tokens_per_s": self.tokens_per_s, "speedup": self.speedup,
            "ar_tokens_per_s": self.ar_tokens_per_s, "expected_tokens": self.expected_tokens,
            "verify_cost_ratio": self.verify_cost_ratio, "ar_step_ms": self.ar_step_s * 1e3,
            "verify_step_ms": self.verify_step_s * 1e3, "draft_round_ms": self.draft_round_s * 1e3,
            "dominant_terms": [{"term": n, "share": round(s, 4)} for n, s in self.dominant(3)],
        }


def predict(shape: ModelShape, hw: HardwareProfile, draft: DraftSpec, acceptance: Acceptance, k: int,
            batch: int = 1, tp: int = 1, context: int = 2048) -> Prediction:
    """Speculative tokens/s and speedup over plain decoding for one (method, k, batch).

        tokens/s   = b * E[tokens](k) / (t_draft(k) + t_verify(n=k+1))
        AR tokens/s = b / t_step(n=1)
    """
    if k < 1:
        raise UserError(f"k must be >= 1 (draft tokens per step), got {k}")
    ar = step_cost(shape, hw, tp, 1, batch, context)
    verify = step_cost(shape, hw, tp, k + 1, batch, context)
    drafting = draft_round_cost(draft, hw, tp, k, batch, context)
    e = acceptance.expected_tokens(k)
    spec_tps = batch * e / (verify.total_s + drafting.total_s)
    ar_tps = batch / ar.total_s
    return Prediction(draft.method, k, batch, e, ar.total_s, verify.total_s, drafting.total_s,
                      spec_tps, ar_tps, spec_tps / ar_tps, verify.total_s / ar.total_s, verify, drafting)


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Efficiency and overhead terms fitted to measured step times, and the fit's residuals."""

    memory_efficiency: float
    compute_efficiency: float
    step_overhead_s: float
    layer_overhead_s: float
    link_latency_s: float | None = None
    collectives_per_layer: float | None = None
    draft_round_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)  # method -> k -> s
    token_overhead_s: float = 0.0
    verify_overhead_s: float = 0.0
    points: tuple[tuple[int, int, float, float], ...] = ()  # (new_tokens, batch, measured_s, fitted_s)
    source: str = ""

    @property
    def max_relative_error(self) -> float:
        return max((abs(f - m) / m for _, _, m, f in self.points), default=0.0)

    def apply(self, hw: HardwareProfile) -> HardwareProfile:
        changes: dict[str, Any] = dict(memory_efficiency=self.memory_efficiency, compute_efficiency=self.compute_efficiency,
                                       step_overhead_s=self.step_overhead_s, layer_overhead_s=self.layer_overhead_s,
                                       token_overhead_s=self.token_overhead_s,
                                       verify_overhead_s=self.verify_overhead_s)
        if self.link_latency_s is not None:
            changes["link_latency_s"] = self.link_latency_s
        if self.collectives_per_layer is not None:
            changes["collectives_per_layer"] = self.collectives_per_layer
        return replace(hw, **changes)

    def summary(self) -> str:
        text = (f"calibrated ({self.source}): memory efficiency {self.memory_efficiency:.2f}, compute efficiency "
                f"{self.compute_efficiency:.2f}, overhead {self.step_overhead_s * 1e3:.3f} ms/step + "
                f"{self.layer_overhead_s * 1e6:.1f} us/layer + {self.token_overhead_s * 1e6:.1f} us/token + "
                f"{self.verify_overhead_s * 1e3:.3f} ms/verification")
        if self.points:
            text += f"; worst step-time residual {self.max_relative_error:.1%} over {len(self.points)} points"
        return text


def _ms(value: Any, what: str, origin: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{origin}: '{what}' must be a positive number of milliseconds, got {value!r}")
    return float(value) / 1e3


def _by_k(value: Any, record: Mapping[str, Any], what: str, origin: str) -> dict[int, float]:
    """A per-k table of seconds from ``{k: ms}`` or a number for the record's own ``k``."""
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            try:
                kk = int(key)
            except (TypeError, ValueError):
                raise UserError(f"{origin}: keys of '{what}' must be integers k, got {key!r}") from None
            out[kk] = _ms(v, f"{what}[{key}]", origin)
        return out
    k = record.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UserError(f"{origin}: '{what}' is a single number but the record has no integer 'k' >= 1; give {{k: ms}}")
    return {k: _ms(value, what, origin)}


def _parse_timing_records(records: Any, context: int, origin: str):
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise UserError(f"{origin}: calibration needs a list of bench records (JSON objects)")
    points: list[tuple[int, int, int, float]] = []  # (n, b, c, seconds)
    drafts: dict[str, dict[int, float]] = {}
    for r in records:
        b = r.get("batch", r.get("batch_size", 1))
        c = r.get("context", context)
        if not isinstance(b, int) or b < 1 or not isinstance(c, int) or c < 0:
            raise UserError(f"{origin}: 'batch' and 'context' must be integers (batch >= 1, context >= 0)")
        plain = r.get("method") == "ar" or r.get("k") == 0  # an autoregressive record: its steps are n=1
        if r.get("ar_step_ms") is not None:
            points.append((1, b, c, _ms(r["ar_step_ms"], "ar_step_ms", origin)))
        if r.get("verify_step_ms") is not None:
            if plain and not isinstance(r["verify_step_ms"], dict):
                points.append((1, b, c, _ms(r["verify_step_ms"], "verify_step_ms", origin)))
            else:
                for k, s in _by_k(r["verify_step_ms"], r, "verify_step_ms", origin).items():
                    points.append((k + 1, b, c, s))
        if r.get("verify_step_ms_by_n") is not None:
            for n, s in _by_k(r["verify_step_ms_by_n"], {}, "verify_step_ms_by_n", origin).items():
                points.append((n, b, c, s))
        draft_ms = r.get("draft_step_ms", r.get("propose_step_ms"))
        if draft_ms is not None and r.get("method") and not plain:
            drafts.setdefault(str(r["method"]), {}).update(_by_k(draft_ms, r, "draft_step_ms", origin))
    has_ar = any(n == 1 for n, *_ in points)
    has_verify = any(n > 1 for n, *_ in points)
    if not (has_ar and has_verify):
        raise UserError(f"{origin}: calibration needs measured step times: 'ar_step_ms' and 'verify_step_ms' "
                        f"(a number for the record's k, or {{k: ms}}) in the bench records; run `outrider bench` "
                        f"with --json to record them")
    # average repeated measurements of the same (n, b, c)
    merged: dict[tuple[int, int, int], list[float]] = {}
    for n, b, c, s in points:
        merged.setdefault((n, b, c), []).append(s)
    return [(n, b, c, sum(v) / len(v)) for (n, b, c), v in sorted(merged.items())], drafts


def _split_overhead(total_s: float, shape: ModelShape, hw: HardwareProfile) -> tuple[float, float]:
    """Split a fitted per-step overhead into the profile's per-step part and a per-layer rest."""
    step = min(hw.step_overhead_s, total_s)
    return step, (total_s - step) / (shape.num_layers + 1)


def _fit_overheads(resid: list[float], regressors: list[list[float]], weights: list[float]) -> list[float]:
    """Weighted least squares of ``resid ~ sum_j c_j * x_j`` with every ``c_j >= 0``.

    regressors: per point, the values of the terms (e.g. 1, new tokens, is-verification). Tries
    every subset of the terms (there are at most three), fits it by its normal equations, keeps
    the non-negative fits and returns the best one's coefficients (0 for terms left out).
    """
    x = np.asarray(regressors, dtype=float)  # [points, terms]
    y = np.asarray(resid, dtype=float)
    sw = np.sqrt(np.asarray(weights, dtype=float))
    best, best_loss = [0.0] * x.shape[1], float(np.sum((sw * y) ** 2))
    for r in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), r):
            a = x[:, cols] * sw[:, None]
            coef, *_ = np.linalg.lstsq(a, sw * y, rcond=None)
            if np.any(coef < 0):
                continue
            loss = float(np.sum((a @ coef - sw * y) ** 2))
            if loss < best_loss * (1 - 1e-12):
                best_loss, best = loss, [0.0] * x.shape[1]
                for c, v in zip(cols, coef):
                    best[c] = float(v)
    return best


def calibrate(bench_records: list[dict], shape: ModelShape, hw: HardwareProfile, tp: int = 1,
              context: int = 2048, origin: str = "bench records") -> Calibration:
    """Fit memory/compute efficiency and the fixed overhead to measured step times.

    Inputs are *step times only*: ``ar_step_ms`` (one token per sequence) and ``verify_step_ms``
    (k+1 tokens; ``{k: ms}`` or a number with the record's ``k``; ``verify_step_ms_by_n`` keys by
    n instead; in an ``ar`` / k=0 record it is a one-token step), at the record's ``batch``
    (or ``batch_size``, default 1) and ``context`` (default ``context``). ``draft_step_ms`` (or
    ``propose_step_ms``: one round of k proposals) is kept as measured and used for that method.
    Measured speedups are never read.

    Fit: for each (eta_mem, eta_cmp) on a log grid, the residual is fitted as a fixed overhead O,
    plus a per-token overhead T times the step's new tokens (where the points hold more than one
    token count), plus a per-verification overhead V on steps of n > 1 (where plain steps and
    several verification widths were measured): weighted least squares on relative error, every
    term >= 0; the pair minimising the squared relative error wins, ties going to the higher
    efficiencies. The AllReduce term keeps the profile's link latency and bandwidth (give
    ``allreduce_share`` through ``calibrate_measured`` to fit it).
    """
    points, drafts = _parse_timing_records(bench_records, context, origin)
    base = replace(hw, memory_efficiency=1.0, compute_efficiency=1.0, step_overhead_s=0.0, layer_overhead_s=0.0,
                   token_overhead_s=0.0)
    # per point: (memory seconds at eff 1, compute seconds at eff 1) per term, and fixed seconds
    prepared = []
    for n, b, c, measured in points:
        cost = step_cost(shape, base, tp, n, b, c)
        parts = []
        fixed = 0.0
        for t in cost.terms:
            if t.bound in ("memory", "compute"):
                parts.append((t.bytes / base.memory_ceiling_bytes_per_s, t.flops / base.flops_ceiling_per_s(t.compute)))
            else:
                fixed += t.time_s
        prepared.append((parts, fixed, measured, n * b))
    grid = [10 ** (-2 + 2 * i / 60) for i in range(60, -1, -1)]  # 1.0 down to 0.01
    weights = [1.0 / (y * y) for _, _, y, _ in prepared]
    # overhead terms: fixed per step; per new token (when the points hold several token counts);
    # per verification (when there are plain steps to set it against)
    tokens = [m for *_, m in prepared]
    verifying = [1.0 if n > 1 else 0.0 for n, *_ in points]
    columns = {"step": [1.0] * len(points)}
    if len(set(tokens)) > 1:
        columns["token"] = [float(m) for m in tokens]
    if 0 < sum(verifying) < len(verifying) and len({m for m, v in zip(tokens, verifying) if v}) > 1:
        columns["verify"] = verifying
    regressors = [list(row) for row in zip(*columns.values())]
    best: tuple[float, float, float, list[float]] | None = None  # loss, eta_m, eta_c, overhead coefficients
    for eta_m in grid:
        for eta_c in grid:
            modelled = [fixed + sum(max(tm / eta_m, tc / eta_c) for tm, tc in parts) for parts, fixed, _, _ in prepared]
            resid = [y - x for x, (_, _, y, _) in zip(modelled, prepared)]
            coef = _fit_overheads(resid, regressors, weights)
            loss = sum(((x + sum(c * v for c, v in zip(coef, row)) - y) / y) ** 2
                       for x, row, (_, _, y, _) in zip(modelled, regressors, prepared))
            if best is None or loss < best[0] * (1 - 1e-9):
                best = (loss, eta_m, eta_c, coef)
    assert best is not None
    _, eta_m, eta_c, coef = best
    fitted = dict(zip(columns, coef))  # term -> seconds
    step_s, layer_s = _split_overhead(fitted["step"], shape, hw)
    cal = Calibration(eta_m, eta_c, step_s, layer_s, draft_round_s=drafts, source=origin,
                      token_overhead_s=fitted.get("token", 0.0), verify_overhead_s=fitted.get("verify", 0.0))
    fitted_hw = cal.apply(hw)
    residuals = tuple((n, b, y, step_cost(shape, fitted_hw, tp, n, b, c).total_s) for n, b, c, y in points)
    return replace(cal, points=residuals)


def calibrate_measured(shape: ModelShape, hw: HardwareProfile, tp: int, single_stream_tokens_per_s: float,
                       allreduce_share: float | None = None, collectives_per_token: float | None = None,
                       context: int = 2048, origin: str = "measured inputs") -> Calibration:
    """Calibrate from a profiling session: single-stream (batch 1) tokens/s, the share of decode
    time spent in AllReduce, and the number of collectives per decoded token.

    The AllReduce share fixes the per-hop link latency (the bandwidth term stays the profile's);
    the rest of the measured step is split between the modelled weight/cache reads and the
    fixed overhead. If the model's reads alone exceed it, both efficiencies are raised (at most
    to 1) so the reads fit, and the overhead is 0.
    """
    if isinstance(single_stream_tokens_per_s, bool) or not isinstance(single_stream_tokens_per_s, (int, float)) \
            or single_stream_tokens_per_s <= 0:
        raise UserError(f"{origin}: 'single_stream_tokens_per_s' must be a positive number")
    step_total = 1.0 / float(single_stream_tokens_per_s)
    cpl = None
    if collectives_per_token is not None:
        if isinstance(collectives_per_token, bool) or not isinstance(collectives_per_token, (int, float)) \
                or collectives_per_token < 0:
            raise UserError(f"{origin}: 'collectives_per_token' must be a number >= 0")
        cpl = float(collectives_per_token) / shape.num_layers
    hw1 = replace(hw, collectives_per_layer=cpl) if cpl is not None else hw
    link_latency = None
    coll_s = step_cost(shape, hw1, tp, 1, 1, context).term_s("AllReduce")
    if allreduce_share is not None:
        if isinstance(allreduce_share, bool) or not isinstance(allreduce_share, (int, float)) or not 0 <= allreduce_share < 1:
            raise UserError(f"{origin}: 'allreduce_share' must be a fraction in [0, 1)")
        if tp <= 1 and allreduce_share > 0:
            raise UserError(f"{origin}: an AllReduce share was given but tp is 1; pass --tp")
        coll_s = allreduce_share * step_total
        if tp > 1:
            count = hw1.collectives_per_layer * shape.num_layers
            if count <= 0:
                raise UserError(f"{origin}: an AllReduce share was given but collectives_per_token is 0")
            per = coll_s / count
            bytes_part = allreduce_s(shape.hidden_size * ACT_BYTES, tp, replace(hw1, link_latency_s=0.0))
            link_latency = max(0.0, per - bytes_part) / (2 * (tp - 1))
    hw2 = replace(hw1, link_latency_s=link_latency) if link_latency is not None else hw1
    reads = step_cost(shape, replace(hw2, step_overhead_s=0.0, layer_overhead_s=0.0), tp, 1, 1, context)
    reads_s = sum(t.time_s for t in reads.terms if t.bound in ("memory", "compute"))
    rest = step_total - coll_s
    if rest <= 0:
        raise UserError(f"{origin}: {single_stream_tokens_per_s:g} tokens/s leaves no time beyond the modelled "
                        f"AllReduce ({coll_s * 1e3:.2f} ms per token); give the measured 'allreduce_share'")
    eta_m, eta_c, overhead = hw.memory_efficiency, hw.compute_efficiency, rest - reads_s
    if overhead < 0:
        scale = reads_s / max(rest, 1e-12)
        eta_m, eta_c, overhead = min(1.0, eta_m * scale), min(1.0, eta_c * scale), 0.0
    step_s, layer_s = _split_overhead(overhead, shape, hw)
    cal = Calibration(eta_m, eta_c, step_s, layer_s, link_latency_s=link_latency, collectives_per_layer=cpl, source=origin)
    fitted = step_cost(shape, cal.apply(hw), tp, 1, 1, context).total_s
    return replace(cal, points=((1, 1, step_total, fitted),))
