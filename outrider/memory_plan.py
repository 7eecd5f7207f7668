"""Device memory of a layer-streamed pass: the weights, the kept states, one chunk's working set.

Contract: pure arithmetic, shared by the streamed capture (``outrider.train.states.stream``, which
measures the working set) and ``outrider plan --train --capture streamed`` (``outrider.plan.train_plan``,
which prices it from the config alone), so that both size a pass the same way.
- ``WorkingSet``: the transient bytes of one decoder-layer step (mask, rotary tables, the layer,
  the final norm) over a chunk of ``T`` padded tokens in rows of width ``w``, the input chunk aside:
  the largest over its phases (attention, MLP or MoE dispatch, the rest) of
  ``per_token * T + per_key * T * w``.
- ``analytic_working_set(arch, itemsize)``: that model from the module shapes, following the eager
  code of transformers' Llama-style attention, DeepSeek-V3's MLA, gated MLPs and the grouped-mm MoE
  dispatch (token-sorted copies of the hidden states, expert outputs, routing weights in float32,
  the unsorted copy), with attention in SDPA's math path (scores materialised in float32: the
  largest of SDPA's kernels). It bounds what the stream measures on the meta device.
- ``StreamMemory``: a budget against the resident weights (the largest layer built, its checkpoint
  bytes and the next layer's), the dequantization temporaries (only while a layer is built), the
  pass's token ids and masks, its states when they stay on the device, and one chunk's working set
  (plus the chunk's input when the states live in host memory), less a reserve (``RESERVE`` of the
  budget) for the allocator's rounding, fragmentation and kernel workspaces. ``peak``,
  ``chunk_fits``, ``largest_chunk(width)``; ``refusal`` is the one line that says why nothing fits,
  with the figures (``size`` writes them).

Not done here: measuring (the stream runs its layer step on the meta device under a live-bytes
count, ``outrider.train.states.workset``), choosing chunks (``stream.plan_chunks``), host memory,
the CUDA allocator's own behaviour beyond the reserve (``benchmarks/stream_bench.py`` prints the
planned against the measured peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from outrider.models import ArchInfo

GB = 1e9
RESERVE = 0.06  # share of the budget kept free: allocator rounding, fragmentation, cuBLAS/kernel workspaces


@dataclass(frozen=True)
class Phase:
    per_token: float  # bytes per padded token
    per_key: float = 0.0  # bytes per padded token per key of its row (masks, attention scores)

    def bytes(self, tokens: int, width: int) -> float:
        return tokens * (self.per_token + self.per_key * width)


@dataclass(frozen=True)
class WorkingSet:
    """Transient bytes of one layer step over a chunk: the largest of its phases."""

    phases: dict[str, Phase]

    def bytes(self, tokens: int, width: int) -> float:
        return max(p.bytes(tokens, width) for p in self.phases.values())

    def largest(self, other: "WorkingSet") -> "WorkingSet":
        """Phase by phase, the larger coefficients of the two (layers of different kinds)."""
        out = dict(self.phases)
        for name, p in other.phases.items():
            q = out.get(name, Phase(0.0))
            out[name] = Phase(max(p.per_token, q.per_token), max(p.per_key, q.per_key))
        return WorkingSet(out)

    def describe(self) -> str:
        return ", ".join(f"{k} {p.per_token / 1e3:.1f} kB/token" + (f" + {p.per_key:.0f} B/token/key" if p.per_key else "")
                         for k, p in self.phases.items())


def analytic_working_set(arch: ArchInfo, itemsize: int, moe: bool | None = None, eager: bool = False) -> WorkingSet:
    """The working set of one decoder layer of ``arch`` (a MoE layer when ``moe``, default: when the
    target has experts) at ``itemsize`` bytes per activation; ``eager``: eager attention (a float
    mask) rather than SDPA (a bool mask)."""
    b, H, n = itemsize, arch.hidden_size, arch.num_heads
    f32 = max(b, 4)
    mask = b if eager else 1
    if arch.attention == "MLA":
        r, nope = arch.qk_rope_head_dim, arch.qk_nope_head_dim
        qk, v = nope + r, arch.v_head_dim or nope
        ql, kvl = arch.q_lora_rank, arch.kv_lora_rank
        # q_a and its norm, q_b, kv_a, its norm, kv_b, rope temporaries, query and key concatenated,
        # the attention output, o_proj
        attn = b * (H + 2 * ql + 2 * (kvl + r) + n * qk + n * (nope + v) + 4 * n * r + 2 * n * qk + n * v + H)
        qkv = n * (2 * qk + v)
    else:
        d, kv = arch.head_dim, arch.num_kv_heads
        # q, k, v; rope (rotate_half temporaries, the rotated q and k); k and v repeated to every
        # head; the attention output; o_proj
        attn = b * (H + 3 * n * d + 3 * kv * d + 2 * n * d + 2 * n * d + n * d + H)
        qkv = 3 * n * d
    # the math path's float32 copies of query, key and value (below float32); per key: the scores and
    # their softmax in float32, the probabilities, the mask
    attention = Phase(2 * H * b + attn + (f32 * qkv if b < f32 else 0), n * (2 * f32 + 2) + mask)
    moe = arch.is_moe if moe is None else moe
    if moe:
        k, E, inter = arch.experts_per_token, arch.num_experts, arch.moe_intermediate_size
        # per routed (token, expert) pair: the sorted copy of the token, the expert's output, the
        # routing-weighted output (float32: the router's weights) and its unsorted copy; sort keys,
        # permutations, weights; or, earlier, the gate-up output and the gated product
        pair = max(b * H + 4 * b * inter, (2 * b + 2 * f32) * H) + 36
        router = 5 * 4 * E  # logits, scores, scores for choice, group mask, masked scores (float32)
        shared = 4 * b * inter * max(1, arch.num_shared_experts)
        mlp = Phase(3 * H * b + max(k * pair, router, shared) + 12 * k, mask)
    else:
        inter = arch.intermediate_size
        mlp = Phase(3 * H * b + 4 * b * inter, mask)  # gate, up, act(gate), the product; down; the mask
    rest = Phase(6 * H * b, mask)  # norms, residual sums, the layer's output, the mask
    return WorkingSet({"attention": attention, "mlp": mlp, "rest": rest})


@dataclass(frozen=True)
class StreamMemory:
    """The device bytes of a streamed pass against a budget (see the module docstring)."""

    budget: float  # bytes
    resident: float  # the largest layer built, its checkpoint bytes and the next layer's
    temporaries: float  # dequantization temporaries, while a layer is built
    state_per_token: float  # kept on the device: the running hidden state, the aux states, the final
    input_per_token: float  # a chunk's input copied to the device when the states live in host memory
    pass_per_token: float  # on the device for the whole pass: token ids, masks, positions
    working: WorkingSet

    @property
    def usable(self) -> float:
        return self.budget * (1 - RESERVE)

    def chunk_bytes(self, tokens: int, width: int, on_device: bool) -> float:
        """One chunk's working set, and its input copy when the states live in host memory."""
        return self.working.bytes(tokens, width) + (0.0 if on_device else self.input_per_token * tokens)

    def peak(self, pass_tokens: int, chunk_tokens: int, width: int, on_device: bool) -> float:
        """The device peak of a pass of ``pass_tokens`` (padded) tokens while its largest chunk runs."""
        states = self.state_per_token * pass_tokens if on_device else 0.0
        during = states + self.chunk_bytes(chunk_tokens, width, on_device)
        return self.resident + self.pass_per_token * pass_tokens + max(self.temporaries, during)

    def chunk_fits(self, chunk_tokens: int, width: int, pass_tokens: int = 0, on_device: bool = False) -> bool:
        return self.peak(max(pass_tokens, chunk_tokens), chunk_tokens, width, on_device) <= self.usable

    def largest_chunk(self, width: int, pass_tokens: int = 0, on_device: bool = False) -> int:
        """Most padded tokens in whole rows of ``width`` that fit; 0: not one row."""
        def fits(rows: int) -> bool:
            return self.chunk_fits(rows * width, width, pass_tokens, on_device)

        lo, hi = 0, 1
        while fits(hi) and hi < 1 << 30:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:  # fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo * width

    def refusal(self, what: str, tokens: int, width: int) -> str:
        """One line: ``what`` (the budget in words) cannot hold a chunk of ``tokens`` padded tokens of
        ``width`` beside a layer, with the figures."""
        chunk = self.chunk_bytes(tokens, width, False)
        need = self.peak(tokens, tokens, width, False) / (1 - RESERVE)
        return (f"{what} is too small for layer streaming: a chunk of {tokens:,} token(s) needs {size(need)} (the "
                f"largest layer built and the checkpoint bytes of two layers {size(self.resident)}, its working set "
                f"{size(chunk)}, a {RESERVE:.0%} reserve): raise --gpu-memory or give shorter examples")


def size(nbytes: float) -> str:
    """Bytes in words: GB, or MB / kB below 0.01 GB."""
    if nbytes >= 1e7:
        return f"{nbytes / GB:.2f} GB"
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e4 else f"{nbytes / 1e3:.2f} kB"
