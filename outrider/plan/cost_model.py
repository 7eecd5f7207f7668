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
  method, k (draft tokens per round) and batch size. A chain round (EAGLE-3 head, draft model) is
  k forwards of one token per sequence; a parallel-drafting round (P-EAGLE, method ``parallel``)
  is ONE forward over k positions per sequence, a DFlash round (method ``dflash``) ONE forward of
  its layers over k + 1; all are verified over k + 1 tokens. EAGLE-2
  trees (``steps`` draft forwards, one target forward over ``draft_tokens``) are priced in
  ``trees`` from the same step costs.

Units are in the names: ``_s`` seconds, ``_bytes``, ``_flops``, ``_per_s``.

Deliberately not modelled: prefill, tree shapes beyond SGLang's budget, expert parallelism and its all-to-all
(tensor parallelism only), load imbalance between GPUs, kernel-level efficiency differences
between matmul shapes, overlap of communication with compute, memory capacity limits on the
batch (a note is raised when the weights do not fit, nothing more).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from outrider.errors import UserError
from outrider.models import ArchInfo
from outrider.plan.acceptance import Acceptance
from outrider.plan.hardware import (
    ACT_BYTES,
    WEIGHT_FORMATS,
    HardwareProfile,
    Precision,
    default_precision,
)

DEFAULT_DRAFT_VOCAB = 32000  # EAGLE-3 heads' usual reduced draft vocabulary




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


def kv_bytes_per_token(shape: ModelShape, tp: int = 1) -> float:
    """Cache bytes one token holds on one GPU, all layers: GQA's keys and values split by KV head over
    TP (replicated beyond the head count), MLA's latent replicated on every rank."""
    kv_shards = 1 if shape.kv_replicated else min(tp, max(1, shape.num_kv_heads))
    return shape.kv_elems_per_token * ACT_BYTES * shape.num_layers / kv_shards


def memory_per_gpu(shape: ModelShape, tp: int, batch: int, tokens: int) -> float:
    """Bytes one GPU holds to decode ``batch`` sequences of ``tokens`` cached tokens: its share of the
    weights plus the KV cache (activations and the engine's workspace not counted)."""
    return shape.weight_bytes / tp + batch * tokens * kv_bytes_per_token(shape, tp)


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
    ctx = context + new_tokens
    kv_bytes = batch * ctx * kv_bytes_per_token(shape, tp)
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


ONE_FORWARD = {"parallel": "parallel", "dflash": "block"}  # methods drafting k tokens in one forward -> draft kind


@dataclass(frozen=True)
class DraftSpec:
    """How a method proposes k tokens: ``ngram`` (free), ``eagle3`` (a head), ``parallel`` (a
    parallel-drafting head: all k in one forward) or ``draft`` (an LM).

    ``measured_round_s`` maps k to a measured draft round (k proposals) in seconds and, where
    present, replaces the model for that k; ``measured_round_by_batch`` maps (k, batch) and wins.
    ``measured_tree_round_s`` / ``..._by_batch`` do the same for tree budgets (topk, steps,
    draft_tokens) (and ((topk, steps, draft_tokens), batch)).
    """

    method: str
    shape: ModelShape | None = None
    fc_params: int = 0  # EAGLE-3: fc over the three aux states, once per round
    measured_round_s: Mapping[int, float] = field(default_factory=dict)
    measured_round_by_batch: Mapping[tuple[int, int], float] = field(default_factory=dict)  # (k, batch) -> s
    measured_tree_round_s: Mapping[tuple[int, int, int], float] = field(default_factory=dict)
    measured_tree_round_by_batch: Mapping[tuple[tuple[int, int, int], int], float] = field(default_factory=dict)


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


def dflash_shape(target: ArchInfo, layers: int = 1, draft_vocab: int = DEFAULT_DRAFT_VOCAB,
                 precision: Precision | None = None, kv_heads: int | None = None) -> DraftSpec:
    """A DFlash block drafter for ``target`` (``heads.dflash``): ``layers`` Qwen3 decoder layers of
    the target's width and head layout (an MLA target's: plain attention of ``H / heads``; ``kv_heads``
    when the drafter has its own), q/k/v over H, the target's MLP width, an lm_head over the draft
    vocabulary and an fc 3H -> H over the new context states once per round."""
    H, heads = target.hidden_size, target.num_heads
    mla = target.attention == "MLA"
    hd = H // heads if mla else (target.head_dim or H // heads)
    kv = kv_heads or (heads if mla else target.num_kv_heads)
    attn = 2 * H * heads * hd + 2 * H * kv * hd
    inter = target.intermediate_size or 4 * H
    bf16 = WEIGHT_FORMATS["bf16"]
    shape = ModelShape(
        name="dflash drafter", num_layers=layers, hidden_size=H, num_heads=heads, num_kv_heads=kv, attention="GQA",
        attn_params=attn, kv_elems_per_token=2 * kv * hd, kv_replicated=False, attn_ctx_flops_per_pos=4 * heads * hd,
        dense_layers=layers, dense_mlp_params=3 * H * inter, moe_layers=0, num_experts=0, experts_per_token=0,
        expert_params=0, shared_params=0, router_params=0, lm_head_params=draft_vocab * H,
        precision=precision or Precision(bf16, bf16),
    )
    return DraftSpec("dflash", shape, fc_params=3 * H * H)


def draft_round_cost(draft: DraftSpec, hw: HardwareProfile, tp: int, k: int, batch: int, context: int) -> StepCost:
    """Cost of proposing k tokens for each of b sequences.

    n-gram: 0 (a lookup on the host, overlapped). EAGLE-3 head / draft model: k sequential
    forwards of one token per sequence, each with its per-layer overhead but no per-step one
    (they run inside the engine's step), plus, for EAGLE-3, one fc over the aux states.
    Parallel drafting: ONE forward over k positions per sequence (the accepted token and k - 1
    placeholders), plus the fc. DFlash: ONE forward of its layers over k + 1 positions (the newest
    token and k masks), plus the fc.
    """
    measured = draft.measured_round_by_batch.get((k, batch), draft.measured_round_s.get(k))
    if measured is not None:
        return StepCost((Term("draft (measured)", measured, bound="overhead"),), k, batch, context)
    if draft.method == "ngram" or draft.shape is None:
        return StepCost((Term("draft (n-gram lookup)", 0.0, bound="overhead"),), k, batch, context)
    if draft.method in ("parallel", "dflash"):
        n = k + 1 if draft.method == "dflash" else k
        cost = step_cost(draft.shape, hw, tp, n, batch, context, include_step_overhead=False).scaled(1.0, "draft ")
    else:
        one = step_cost(draft.shape, hw, tp, 1, batch, context, include_step_overhead=False)
        cost = one.scaled(k, prefix="draft ")
    if draft.fc_params:
        fc = _roofline("draft fc", draft.fc_params * draft.shape.precision.other.bytes_per_param / tp,
                       2 * draft.fc_params * batch / tp, hw)
        cost = StepCost(cost.terms + (fc,), k, batch, context)
    return cost


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
    batching: str = "continuous"  # "lockstep": the batch runs as long as its slowest row (``batching``)
    tokens_per_round: float | None = None  # lockstep: tokens a row gains per round of its batch
    memory_bytes: float = 0.0  # per GPU: weights + KV cache at the plan's context (``memory_per_gpu``)
    fits: bool = True  # memory_bytes within the GPU's memory
    draft_kind: str = "chain"  # "chain" | "tree" (EAGLE-2 budget) | "parallel" | "block" (one draft forward)
    tree: tuple[int, int, int] | None = None  # SGLang's (topk, steps, draft_tokens); a chain of k is (1, k, k+1)
    launch: str | None = None  # the serving flags of this row (SGLang's for EAGLE-3 chains and trees)

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
            "batching": self.batching, "tokens_per_round": self.tokens_per_round,
            "verify_step_ms": self.verify_step_s * 1e3, "draft_round_ms": self.draft_round_s * 1e3,
            "dominant_terms": [{"term": n, "share": round(s, 4)} for n, s in self.dominant(3)],
            "memory_gb_per_gpu": round(self.memory_bytes / 1e9, 3), "fits_memory": self.fits,
            "verify_terms_ms": _terms_ms(self.verify), "draft_terms_ms": _terms_ms(self.draft),
            "draft": self.draft_kind, "topk": self.tree[0] if self.tree else None,
            "steps": self.tree[1] if self.tree else None, "draft_tokens": self.tree[2] if self.tree else None,
            "launch": self.launch,
        }


def _terms_ms(cost: StepCost) -> dict[str, float]:
    """A step's named terms in milliseconds (terms of one name summed), for the JSON rows."""
    out: dict[str, float] = {}
    for t in cost.terms:
        out[t.name] = out.get(t.name, 0.0) + t.time_s * 1e3
    return out


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
                      spec_tps, ar_tps, spec_tps / ar_tps, verify.total_s / ar.total_s, verify, drafting,
                      draft_kind=ONE_FORWARD.get(draft.method, "chain"))
