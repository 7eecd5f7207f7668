"""``outrider plan T --train``: what training an EAGLE-3 head for T takes, stage by stage, and what it gives.

Contract: ``train_plan(...)`` returns a ``TrainPlan``: for each stage (regeneration, capture,
cache, head training, evaluation) its time on the given GPUs, GPU-hours, peak memory per GPU and
disk, each a ``Figure`` carrying its formula with the numbers put in and the rates behind it
(``rates.RATES``: measured by us, an estimate, or a formula; the cost model for served decoding
and weight sizes); and the expected held-out tau as a range from our learning curve
(``learning``). ``train_report`` renders it. Sizes: C conversations of M turns of L tokens; an
example is one conversation cut at ``max_length`` (S = C x min(M L, max_length) distinct
tokens), whose reply share is regenerated; training reads S x E tokens.

Stage models:
- regeneration ``served``: a serving engine on the plan's GPUs at TP = GPUs, or on a node of
  ``serve_gpus`` GPUs of the same kind when the weights do not fit the plan's; decode tokens/s
  from the cost model at ``served_batch`` sequences (fewer if their KV cache does not fit).
  ``local``: our engine, one copy per GPU: our measured rate times the cost model's ratio of
  this target on this GPU to the default target on an H200. ``none``: the data's own replies.
- capture ``online``: the target's forward inside each training step (every rank holds the
  target; its FLOPs are the training's). ``streamed``: layer by layer from storage, one rank per
  GPU of one host (``torchrun``); each pass of ``pass_tokens`` (the streamer's default, its states
  on the GPU when they fit, else in pinned host memory) streams every weight once per rank; its
  memory is ``outrider.memory_plan``'s, as the capture sizes itself: two stored layers and one
  widened to bf16, the states, one chunk's working set (analytic; refused in one line when not one
  example fits); time = max(weight
  reads, FLOPs / (GPUs x peak x efficiency), cache bytes / write rate). Weight reads: each rank
  at most ``stream_bytes_per_s``; when host memory holds the checkpoint beside every rank's
  pinned buffers the page cache keeps it (storage reads it once), else every pass of every rank
  reads it again and N ranks share ``storage_read_bytes_per_s``; the notes give the bound on N.
  ``engine`` (formerly ``served``): vLLM's ``extract_hidden_states`` on a tensor-parallel server
  (``capture --engine vllm``): its prefill over every token, the states written out. Cached modes store 4 x H values per token (three aux states and
  the last): bf16 4H x 2 B, fp8 4H x (1 + 4/H) B (one fp32 scale per row of H values).
- training: FLOPs per token in ``outrider.train.loop.flops``' conventions (the target's forward when
  online; the head's forward and backward over ``ttt_steps``; lm_head at the loss positions);
  time = tokens x FLOPs / (GPUs x peak x MFU), MFU measured on our runs over a whole run; a cache
  must also be read fast enough. Memory: the head's fp32 weights, gradients and Adam moments
  (16 B per parameter), the target's embedding, one micro-batch's activations (34 x H bytes per
  token per unrolled step, Korthikanti et al. 2022, arXiv 2205.05198, without the attention
  scores) and teacher logits, plus the target when online.
- evaluation: a warm-up, then ``eval_repeats`` plain and speculative passes over the prompts at
  batch 1, decode rates from ``cost_model.predict`` at the expected tau.

Not done here: the decode planner (``planner``), measuring anything, multi-node training."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from outrider.errors import UserError
from outrider.memory_plan import RESERVE, StreamMemory, analytic_working_set, size
from outrider.models import ArchInfo
from outrider.plan import rates as R
from outrider.plan.acceptance import Acceptance
from outrider.plan.batching import multiplier_for, scaled
from outrider.plan.cost_model import (
    DraftSpec,
    ModelShape,
    eagle3_head_shape,
    predict,
    step_cost,
)
from outrider.plan.hardware import (
    ACT_BYTES,
    HardwareProfile,
    load_profile,
    parse_precision,
)
from outrider.plan.learning import Curve, Estimate, fit_curve
from outrider.plan.measured import fit_profile, load_measured
from outrider.plan.presets import PRESETS, resolve_target

REGENERATE = ("served", "local", "none")
CAPTURE = ("online", "streamed", "engine")
CAPTURE_ALIASES = {"served": "engine"}  # the name before `capture --engine vllm` existed
CACHE_DTYPES = ("bf16", "fp8")
FIT = 0.9  # share of a GPU's memory a plan may fill
STREAM_PASS_TOKENS = 262144  # StreamedTarget's defaults on CUDA: tokens per pass, padded tokens per chunk,
STREAM_CHUNK_TOKENS = 32768  # dequantization temporaries
STREAM_TEMP_BYTES = 1 << 30
ACT_BYTES_PER_H = 34  # activation bytes per token per hidden unit of one layer (no recomputation)


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str  # "s", "GB", ...
    formula: str
    sources: tuple[str, ...] = ()  # names in rates.RATES, or a source in words


@dataclass
class Stage:
    name: str
    mode: str
    gpus: int
    hardware: str
    time: Figure
    memory: Figure
    disk: Figure
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_hours(self) -> Figure:
        h = self.time.value * self.gpus / 3600
        return Figure(h, "GPU-h", f"{self.time.value:,.0f} s x {self.gpus} GPU / 3600")


@dataclass(frozen=True)
class Sizes:
    conversations: int
    turns: int
    tokens_per_turn: int
    epochs: float
    max_length: int
    reply_share: float

    @property
    def example_tokens(self) -> int:
        return min(self.turns * self.tokens_per_turn, self.max_length)

    @property
    def distinct_tokens(self) -> float:
        return float(self.conversations * self.example_tokens)

    @property
    def generated_tokens(self) -> float:
        return self.distinct_tokens * self.reply_share

    @property
    def train_tokens(self) -> float:
        return self.distinct_tokens * self.epochs


@dataclass
class TrainPlan:
    target: str
    hardware: HardwareProfile
    gpus: int
    sizes: Sizes
    stages: list[Stage]
    tau: Estimate
    tau_k: int
    tau_at_k: tuple[float, float, float]  # central, low, high at tau_k
    curve: Curve
    rates: dict[str, R.Rate]
    notes: list[str]
    calibration: str = ""

    @property
    def total_s(self) -> float:
        return sum(s.time.value for s in self.stages)

    @property
    def total_gpu_hours(self) -> float:
        return sum(s.gpu_hours.value for s in self.stages)

    @property
    def disk_gb(self) -> float:
        return sum(s.disk.value for s in self.stages)


# --------------------------------------------------------------------------------------------
# Sizes of the target and the head


def fits(shape: ModelShape, hw: HardwareProfile, gpus: int) -> bool:
    return shape.weight_bytes / gpus < FIT * hw.memory_capacity_bytes


def active_params(shape: ModelShape, draft_vocab: int) -> float:
    """Matmul parameters one token runs through in the target: routed experts at top-k, and the
    draft rows of lm_head instead of all of it (capture needs no full-vocabulary logits)."""
    routed = shape.moe_layers * (shape.experts_per_token * shape.expert_params + shape.router_params)
    dense = shape.dense_layers * shape.dense_mlp_params + shape.moe_layers * shape.shared_params
    return shape.num_layers * shape.attn_params + dense + routed + draft_vocab * shape.hidden_size


def target_flops_per_token(shape: ModelShape, draft_vocab: int, example_tokens: int) -> float:
    """2 x active params + attention products over (T + 1) / 2 positions on average."""
    attn = shape.num_layers * shape.attn_ctx_flops_per_pos * (example_tokens + 1) / 2
    return 2 * active_params(shape, draft_vocab) + attn


def head_params(head: DraftSpec) -> float:
    s = head.shape
    return s.attn_params + s.dense_mlp_params + s.lm_head_params + head.fc_params


def head_flops_per_token(head: DraftSpec, ttt_steps: int, loss_share: float, example_tokens: int) -> float:
    """6 x (layer) x steps + 6 x lm_head x loss share x steps + 6 x fc + attention, forward and backward."""
    s = head.shape
    body = s.attn_params + s.dense_mlp_params
    attn = sum(3 * s.attn_ctx_flops_per_pos * ((example_tokens + 1) / 2 + j) for j in range(ttt_steps))
    return 6 * body * ttt_steps + 6 * s.lm_head_params * loss_share * ttt_steps + 6 * head.fc_params + attn


def cache_bytes_per_token(hidden: int, dtype: str) -> tuple[float, str]:
    """Three aux states and the last one: 4 x H values per token."""
    if dtype == "bf16":
        return 4 * hidden * 2.0, f"4 x H x 2 B = 4 x {hidden} x 2"
    if dtype == "fp8":
        return 4 * hidden * (1 + 4 / hidden), f"4 x H x (1 + 4/H) B = 4 x {hidden} + 16 (one fp32 scale per row)"
    raise UserError(f"unknown cache dtype '{dtype}': use one of {', '.join(CACHE_DTYPES)}")


def kv_bytes_per_token(shape: ModelShape, tp: int) -> float:
    shards = 1 if shape.kv_replicated else min(tp, max(1, shape.num_kv_heads))
    return shape.kv_elems_per_token * ACT_BYTES * shape.num_layers / shards


def inflight_bytes_per_token(shape: ModelShape) -> float:
    """GPU bytes per token of a layer-streamed pass: residual, normed input, attention output and the
    kept aux/final states (8 x H), plus the MLP's widest intermediate (gate and up) for one token."""
    inter = max(shape.dense_mlp_params if shape.dense_layers else 0,
                shape.experts_per_token * shape.expert_params + shape.shared_params) / (3 * shape.hidden_size)
    return (8 * shape.hidden_size + 2 * inter) * ACT_BYTES


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class _Ctx:
    name: str
    arch: ArchInfo
    shape: ModelShape
    hw: HardwareProfile
    gpus: int
    sizes: Sizes
    rates: dict[str, R.Rate]
    head: DraftSpec
    draft_vocab: int
    ttt_steps: int
    micro_batch_tokens: int
    serve_gpus: int
    serve_hw: HardwareProfile  # the plan's hardware, calibrated by --measured where given
    cache_dtype: str
    calibration: str  # where the serving profile comes from
    notes: list[str]

    def rate(self, name: str) -> float:
        return self.rates[name].value

    def placement(self) -> tuple[int, str]:
        """GPUs (= TP) that serve the target: the plan's if the weights fit them, else a node."""
        if fits(self.shape, self.serve_hw, self.gpus):
            return self.gpus, f"{self.gpus} x {self.hw.name} (the plan's GPUs)"
        if not fits(self.shape, self.serve_hw, self.serve_gpus):
            raise UserError(f"{self.name} needs {self.shape.weight_bytes / 1e9:,.0f} GB of weights: it fits neither "
                            f"{self.gpus} nor {self.serve_gpus} x {self.hw.name}; raise --serve-gpus")
        return self.serve_gpus, (f"a node of {self.serve_gpus} x {self.hw.name} (--serve-gpus): the weights "
                                 f"({self.shape.weight_bytes / 1e9:,.0f} GB) do not fit {self.gpus} of them")


def _regeneration(c: _Ctx, mode: str) -> Stage:
    s, shape = c.sizes, c.shape
    S, G = s.distinct_tokens, s.generated_tokens
    data_disk = Figure(S * c.rate("token_bytes") / 1e9, "GB", f"S x {c.rate('token_bytes'):g} B = {S:,.0f} x "
                       f"{c.rate('token_bytes'):g} B (token ids and loss masks, before compression)", ("token_bytes",))
    gtext = (f"G = C x min(M L, max_length) x reply share = {s.conversations:,} x {s.example_tokens:,} x "
             f"{s.reply_share:.2f} = {G:,.0f} tokens")
    if mode == "none":
        return Stage("regeneration", "none", 0, "-", Figure(0.0, "s", "no regeneration: the data's own replies are "
                     "learned (replies the target did not write lower the acceptance the head reaches)"),
                     Figure(0.0, "GB", "-"), data_disk)
    ctx_len = s.example_tokens * (1 - s.reply_share / 2)  # mean context while a reply is written
    if mode == "local":
        if not fits(shape, c.hw, 1):
            raise UserError(f"--regenerate local runs {c.name} on one {c.hw.name}, but its "
                            f"{shape.weight_bytes / 1e9:,.0f} GB of weights do not fit one: use --regenerate served")
        _, d_arch, d_prec = PRESETS["default"]
        d_shape = ModelShape.from_arch(d_arch, parse_precision(d_prec))
        b = int(c.rate("regen_batch"))
        ours = decode_tokens_per_s(d_shape, load_profile("h200"), 1, b, int(c.rate("regen_context")))
        here = decode_tokens_per_s(shape, c.hw, 1, b, int(ctx_len))
        per_gpu = c.rate("regen_tokens_per_s") * here / ours
        t = G / (per_gpu * c.gpus)
        time = Figure(t, "s", f"{gtext}; G / (rate x GPUs) = {G:,.0f} / ({per_gpu:,.0f} x {c.gpus}); rate = our "
                      f"{c.rate('regen_tokens_per_s'):,.0f} tok/s x cost-model ratio {here / ours:.3f} (this target "
                      f"on {c.hw.name} at context {ctx_len:,.0f} / the default on h200 at {c.rate('regen_context'):,.0f}, "
                      f"batch {b})", ("regen_tokens_per_s", "regen_batch", "regen_context"))
        kv = b * s.example_tokens * kv_bytes_per_token(shape, 1)
        mem = Figure((shape.weight_bytes + kv) / 1e9, "GB", f"weights {shape.weight_bytes / 1e9:.2f} GB + KV of "
                     f"{b} x {s.example_tokens} tokens {kv / 1e9:.2f} GB", ("regen_batch",))
        return Stage("regeneration", "local", c.gpus, c.hw.name, time, mem, data_disk)
    tp, where = c.placement()
    free = FIT * c.serve_hw.memory_capacity_bytes - shape.weight_bytes / tp
    per_seq = s.example_tokens * kv_bytes_per_token(shape, tp)
    b = max(1, min(int(c.rate("served_batch")), int(free // per_seq)))
    tps = decode_tokens_per_s(shape, c.serve_hw, tp, b, int(ctx_len))
    prompts = S * (1 - s.reply_share)
    t_pre = prompts * 2 * active_params(shape, c.draft_vocab) / (tp * c.serve_hw.bf16_flops_per_s
                                                                   * c.rate("served_prefill_efficiency"))
    start = c.rate("server_start_s")
    t = G / tps + t_pre + start
    time = Figure(t, "s", f"{gtext}; G / decode rate + prompts' prefill + server start = {G:,.0f} / {tps:,.0f} + "
                  f"{t_pre:,.0f} + {start:,.0f} s; decode rate = cost model at batch {b}, TP {tp}, context "
                  f"{ctx_len:,.0f}", ("served_batch", "served_prefill_efficiency", "server_start_s",
                                      f"cost model on {where} ({c.calibration})"))
    mem = Figure((shape.weight_bytes / tp + b * per_seq) / 1e9, "GB", f"weights / TP {shape.weight_bytes / tp / 1e9:.1f} "
                 f"GB + KV of {b} x {s.example_tokens} tokens {b * per_seq / 1e9:.2f} GB", ("served_batch",))
    return Stage("regeneration", "served", tp, c.hw.name, time, mem, data_disk, [f"served on {where}"])


def _capture(c: _Ctx, mode: str) -> Stage:
    s, shape = c.sizes, c.shape
    S = s.distinct_tokens
    flops = target_flops_per_token(shape, c.draft_vocab, s.example_tokens)
    bpt, _ = cache_bytes_per_token(shape.hidden_size, c.cache_dtype)
    write = S * bpt / c.rate("disk_write_bytes_per_s")
    if mode == "online":
        if not fits(shape, c.hw, 1):
            raise UserError(f"--capture online keeps {c.name} ({shape.weight_bytes / 1e9:,.0f} GB) on every training "
                            f"GPU, but it does not fit one {c.hw.name}: use --capture streamed or engine")
        return Stage("capture", "online", 0, c.hw.name,
                     Figure(0.0, "s", f"inside each training step: the target's forward, {flops / 1e9:.3g} GFLOP per "
                            f"token, is counted in the training's FLOPs"),
                     Figure(0.0, "GB", "in the training's memory"), Figure(0.0, "GB", "nothing stored"))
    if mode == "streamed":
        share = S / c.gpus
        sm, pass_tokens, chunk, on_device = _stream_memory(c, share)
        stored = shape.weight_bytes / shape.num_layers
        passes = math.ceil(share / pass_tokens)
        t_stream, stream_text, host_notes = _streamed_reads(c, passes, pass_tokens, stored)
        eff = c.rate("capture_compute_efficiency")
        t_cmp = S * flops / (c.gpus * c.hw.flops_ceiling_per_s("bf16") * eff)
        t = max(t_stream, t_cmp, write)
        time = Figure(t, "s", f"max(weight reads, FLOPs / (GPUs x ceiling x efficiency), cache / write rate) = "
                      f"max({stream_text}, {S:,.0f} x {flops / 1e9:.3g} GFLOP / ({c.gpus} x "
                      f"{c.hw.flops_ceiling_per_s('bf16') / 1e12:,.0f} TFLOP/s x {eff:g}) = {t_cmp:,.0f} s, {write:,.0f} s)",
                      ("stream_bytes_per_s", "storage_read_bytes_per_s", "host_memory_bytes",
                       "capture_compute_efficiency", "disk_write_bytes_per_s"))
        width = s.example_tokens
        peak = sm.peak(int(pass_tokens), chunk, width, on_device)
        where = "on the GPU" if on_device else "in pinned host memory"
        mem = Figure(peak / 1e9, "GB", f"layer {sm.resident / 1e9:.1f} GB (the largest built and two layers' stored "
                     f"bytes) + states of {pass_tokens:,.0f} tokens {where} + a chunk of {chunk:,} tokens (rows of "
                     f"{width:,}: {sm.working.describe()}) = {size(peak)}, under {sm.budget / 1e9:.1f} GB with a "
                     f"{RESERVE:.0%} reserve (outrider.memory_plan, as the streamed capture sizes itself)")
        return Stage("capture", "streamed", c.gpus, c.hw.name, time, mem, Figure(0.0, "GB", "the cache (next stage)"),
                     [f"{passes} pass(es) per GPU of up to {pass_tokens:,.0f} tokens; each rank reads the weights "
                      f"once per pass (`torchrun --nproc-per-node {c.gpus} -m outrider capture --stream-layers`)"]
                     + host_notes)
    tp, where = c.placement()
    eff = c.rate("served_prefill_efficiency")
    t_pre = S * flops / (tp * c.serve_hw.flops_ceiling_per_s("bf16") * eff)
    start = c.rate("server_start_s")
    t = max(t_pre, write) + start
    time = Figure(t, "s", f"max(prefill FLOPs / (GPUs x ceiling x efficiency), cache / write rate) + server start = "
                  f"max({S:,.0f} x {flops / 1e9:.3g} GFLOP / ({tp} x {c.serve_hw.flops_ceiling_per_s('bf16') / 1e12:,.0f} "
                  f"TFLOP/s x {eff:g}) = {t_pre:,.0f} s, {write:,.0f} s) + {start:,.0f} s",
                  ("served_prefill_efficiency", "disk_write_bytes_per_s", "server_start_s"))
    chunk = 8192 * inflight_bytes_per_token(shape)
    mem = Figure((shape.weight_bytes / tp + chunk) / 1e9, "GB", f"weights / TP {shape.weight_bytes / tp / 1e9:.1f} GB + "
                 f"an 8,192-token prefill chunk {chunk / 1e9:.2f} GB")
    return Stage("capture", "engine", tp, c.hw.name, time, mem, Figure(0.0, "GB", "the cache (next stage)"),
                 [f"vLLM on {where} extracts the states (`vllm serve T --tensor-parallel-size {tp}` with "
                  "`outrider capture T --engine vllm --print-command`'s extraction config, then `outrider capture T "
                  "--engine vllm --server URL --engine-storage DIR`)",
                  f"{S / time.value:,.0f} tokens/s over the whole capture; {bpt:,.0f} B of cache per token "
                  f"({c.cache_dtype}: 4 x H = 4 x {shape.hidden_size:,} values)"])


def _capture_alternative(c: _Ctx, mode: str) -> str:
    """One capture mode's time and GPU-hours on this plan, or why it does not apply."""
    try:
        st = _capture(c, mode)
    except UserError as e:
        return f"{mode}: {e}"
    if mode == "online":
        return "online: inside training (the target's forward in every step)"
    return f"{mode}: {st.time.value / 60:,.1f} min on {st.gpus} GPU(s), {st.time.value * st.gpus / 3600:,.2f} GPU-h"


def _stream_memory(c: _Ctx, share: float) -> tuple[StreamMemory, float, int, bool]:
    """The streamed capture's memory plan on one GPU (``outrider.memory_plan``, as ``StreamedTarget``
    sizes itself with its defaults): the plan, tokens per pass, chunk tokens, states on the device."""
    shape, width = c.shape, c.sizes.example_tokens
    L, H = shape.num_layers, shape.hidden_size
    stored = shape.weight_bytes / L
    widened = shape.total_params / L * ACT_BYTES  # one layer in bf16 for the matmuls
    built = widened if widened > stored * 1.01 else 0.0
    mem = StreamMemory(FIT * c.hw.memory_capacity_bytes, resident=2 * stored + built,
                       temporaries=2 * min(STREAM_TEMP_BYTES, built), state_per_token=H * ACT_BYTES * 5,
                       input_per_token=H * ACT_BYTES, pass_per_token=24, working=analytic_working_set(c.arch, ACT_BYTES))
    pass_tokens = max(float(width), min(share, STREAM_PASS_TOKENS))
    for on_device in (True, False):
        chunk = min(mem.largest_chunk(width, int(pass_tokens), on_device), STREAM_CHUNK_TOKENS // width * width)
        if chunk >= width:
            return mem, pass_tokens, chunk, on_device
    raise UserError(f"streamed capture of {c.name}: " + mem.refusal(
        f"one {c.hw.name} ({FIT:.0%} of {c.hw.memory_capacity_bytes / 1e9:.0f} GB)", width, width))


def _streamed_reads(c: _Ctx, passes: int, pass_tokens: float, layer_bytes: float) -> tuple[float, str, list[str]]:
    """Seconds for N = GPUs streamed ranks on one host to read the weights ``passes`` times each, the
    formula, and the host limits. Each rank reads at most ``stream_bytes_per_s``. The page cache keeps
    the checkpoint when host memory holds it beside every rank's pinned buffers (two layers and a
    pass's states): the storage then delivers it once and the ranks share it; otherwise every pass of
    every rank reads it from storage again, N ranks sharing ``storage_read_bytes_per_s``."""
    W, N = c.shape.weight_bytes, c.gpus
    stream, storage, host = c.rate("stream_bytes_per_s"), c.rate("storage_read_bytes_per_s"), c.rate("host_memory_bytes")
    per_rank = 2 * layer_bytes + pass_tokens * 5 * c.shape.hidden_size * ACT_BYTES  # read buffers, pinned states
    cached = W + N * per_rank <= host
    most = max(0, int((host - W) // per_rank))  # ranks whose buffers fit beside the cached checkpoint
    if cached:
        t = W / min(stream, storage) + (passes - 1) * W / stream
        text = (f"first pass from storage {W / 1e9:,.0f} GB / {min(stream, storage) / 1e9:g} GB/s + {passes - 1} from the "
                f"page cache at {stream / 1e9:g} GB/s per rank = {t:,.0f} s")
    else:
        rate = min(stream, storage / N)
        t = passes * W / rate
        text = (f"{passes} passes x {W / 1e9:,.0f} GB / min({stream / 1e9:g} GB/s per rank, {storage / 1e9:g} GB/s "
                f"storage / {N} ranks) = {t:,.0f} s")
    notes = [f"host: the checkpoint ({W / 1e9:,.0f} GB) {'stays' if cached else 'does not stay'} in the page cache "
             f"beside {N} rank(s) x {per_rank / 1e9:,.1f} GB of pinned buffers ({host / 1e9:,.0f} GB host memory, "
             f"`host_memory_bytes`); up to {most} streamed rank(s) keep it cached"]
    if not cached:
        useful = max(1, int(storage // stream))
        notes.append(f"uncached, every pass of every rank reads the checkpoint from storage: beyond {useful} rank(s) "
                     f"({storage / 1e9:g} GB/s storage / {stream / 1e9:g} GB/s per rank) more GPUs add no speed")
    return t, text, notes


def _cache(c: _Ctx, capture: str) -> Stage:
    if capture == "online":
        return Stage("cache", "none", 0, "-", Figure(0.0, "s", "online capture stores nothing"), Figure(0.0, "GB", "-"),
                     Figure(0.0, "GB", "-"))
    S = c.sizes.distinct_tokens
    bpt, text = cache_bytes_per_token(c.shape.hidden_size, c.cache_dtype)
    size = S * bpt
    write = size / c.rate("disk_write_bytes_per_s")
    return Stage("cache", c.cache_dtype, 0, "-",
                 Figure(0.0, "s", f"written while capturing ({size / 1e9:,.0f} GB / "
                        f"{c.rate('disk_write_bytes_per_s') / 1e9:g} GB/s = {write:,.0f} s, inside the capture's time)",
                        ("disk_write_bytes_per_s",)),
                 Figure(0.0, "GB", "host side"),
                 Figure(size / 1e9, "GB", f"S x bytes per token = {S:,.0f} x {bpt:,.0f} B; {text}", ("formula",)))


def _training(c: _Ctx, capture: str) -> Stage:
    s, shape, head = c.sizes, c.shape, c.head
    N = s.train_tokens
    f_head = head_flops_per_token(head, c.ttt_steps, s.reply_share, s.example_tokens)
    online = capture == "online"
    f_target = target_flops_per_token(shape, c.draft_vocab, s.example_tokens) if online else 0.0
    flops = f_head + f_target
    peak, mfu, mfu_step = c.hw.bf16_flops_per_s, c.rate("train_mfu_run"), c.rate("train_mfu_step")
    t = N * flops / (c.gpus * peak * mfu)
    fast = N * flops / (c.gpus * peak * mfu_step)
    parts = f"head {f_head / 1e9:.3g}" + (f" + target forward {f_target / 1e9:.3g}" if online else "")
    formula = (f"N x FLOPs / (GPUs x peak x MFU) = {N:,.0f} x ({parts}) GFLOP / ({c.gpus} x {peak / 1e12:,.0f} TFLOP/s x "
               f"{mfu:.3f}); at the median step's MFU {mfu_step:.3f}: {fast:,.0f} s")
    notes = []
    if not online:
        bpt, _ = cache_bytes_per_token(shape.hidden_size, c.cache_dtype)
        t_read = N * bpt / c.rate("disk_read_bytes_per_s")
        formula += f"; cache reads {N:,.0f} x {bpt:,.0f} B / {c.rate('disk_read_bytes_per_s') / 1e9:g} GB/s = {t_read:,.0f} s"
        if t_read > t:
            notes.append("the cache's reads, not the GPUs, bound the training: read from faster storage")
            t = t_read
    time = Figure(t, "s", formula, ("train_mfu_run", "train_mfu_step", "train_peak_flops_per_s")
                  + (() if online else ("disk_read_bytes_per_s",)))
    p = head_params(head)
    m = c.micro_batch_tokens
    states = 16 * p
    embed = shape.hidden_size * c.arch.vocab_size * ACT_BYTES
    acts = m * c.ttt_steps * ACT_BYTES_PER_H * head.shape.hidden_size
    teacher = m * c.draft_vocab * ACT_BYTES
    target = shape.weight_bytes + m * inflight_bytes_per_token(shape) if online else 0.0
    total = states + embed + acts + teacher + target
    mem = Figure(total / 1e9, "GB", f"head states 16 B x {p / 1e6:,.0f} M params {states / 1e9:.2f} GB + target "
                 f"embedding {embed / 1e9:.2f} GB + activations {m:,} tokens x {c.ttt_steps} steps x "
                 f"{ACT_BYTES_PER_H} x H {acts / 1e9:.2f} GB + teacher logits {teacher / 1e9:.2f} GB"
                 + (f" + the target and its forward {target / 1e9:.2f} GB" if online else ""))
    ckpt = Figure(p * 16 / 1e9, "GB", f"checkpoint: fp32 head, its Adam moments and the best head, "
                  f"16 B x {p / 1e6:,.0f} M params")
    return Stage("training", "online" if online else f"from the {c.cache_dtype} cache", c.gpus, c.hw.name, time,
                 mem, ckpt, notes)


def _evaluation(c: _Ctx, tau: float, k: int, prompts: int, new_tokens: int, repeats: int) -> Stage:
    shape = c.shape
    tp, where = c.placement()
    served = not fits(shape, c.hw, 1)
    pred = predict(shape, c.serve_hw, c.head, Acceptance.from_tau(min(tau, k + 0.999), k), k, 1, tp, 2048)
    ar, sources = pred.ar_tokens_per_s, ["server_start_s" if served else "eval_warmup_s"]
    if c.name == PRESETS["default"][0] and c.hw.name == "h200" and c.serve_hw is c.hw:
        ar = c.rate("eval_ar_tokens_per_s")  # our engine on the default target, measured
        sources.append("eval_ar_tokens_per_s")
    spec = ar * pred.speedup
    tokens = prompts * new_tokens
    passes = repeats * (tokens / ar + tokens / spec)
    warm = c.rate("server_start_s") * 2 if served else c.rate("eval_warmup_s")
    t = warm + passes
    time = Figure(t, "s", f"warm-up + {repeats} x (plain + speculative) passes of {prompts} x {new_tokens} tokens = "
                  f"{warm:,.0f} + {repeats} x ({tokens:,} / {ar:,.0f} + {tokens:,} / {spec:,.0f} tok/s) s; the "
                  f"speedup {pred.speedup:.2f}x from the cost model at tau {tau:.2f}, k = {k}",
                  tuple(sources) + (f"cost model on {where} ({c.calibration})",))
    p = head_params(c.head)
    mem = Figure((shape.weight_bytes / tp + p * 2) / 1e9, "GB", f"weights / TP {shape.weight_bytes / tp / 1e9:.1f} GB + "
                 f"the head in bf16 {p * 2 / 1e9:.2f} GB (+ a small KV cache)")
    return Stage("evaluation", "served" if served else "our engine", tp, c.hw.name, time, mem,
                 Figure(p * 2 / 1e9, "GB", f"the exported head: 2 B x {p / 1e6:,.0f} M params"),
                 [f"on {where}; expected speedup at batch 1: {pred.speedup:.2f}x"])


def tau_at_k(tau5: float, k: int) -> float:
    """A tau@5 of our curve at another k, through our measured per-position profile scaled by one multiplier."""
    rates5 = R.ROW_SPREAD_RATES
    c = multiplier_for(rates5, tau5)
    return Acceptance(scaled(rates5, c)).expected_tokens(k)


def train_plan(target: str, hardware: str, gpus: int = 1, conversations: int = 20_000, turns: int = 1,
               tokens_per_turn: int = 400, epochs: float = 10.0, regenerate: str | None = None,
               capture: str | None = None, cache_dtype: str = "bf16", max_length: int = 1024, k: int = 5,
               weight_dtype: str | None = None, serve_gpus: int = 8, measured: Any = None, rates: Any = None,
               draft_vocab: int = 32_000, ttt_steps: int = 7, micro_batch_tokens: int = 32_768,
               eval_prompts: int = 30, eval_new_tokens: int = 128, eval_repeats: int = 3) -> TrainPlan:
    """The plan (see the module docstring). ``measured`` is a ``measured.Measured`` (or a path) that
    calibrates the served stages' profile; ``rates`` overrides ``rates.RATES`` (``with_overrides``).
    ``regenerate`` / ``capture`` default to what fits: local and online when the target fits one GPU,
    else engine (the target fits the plan's GPUs: vLLM extracts the states) or streamed (it does not)."""
    for name, v in (("--gpus", gpus), ("--conversations", conversations), ("--turns", turns),
                    ("--tokens-per-turn", tokens_per_turn), ("--serve-gpus", serve_gpus), ("k", k),
                    ("max_length", max_length), ("micro-batch tokens", micro_batch_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{name} must be an integer >= 1, got {v!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
        raise UserError(f"--epochs must be a number > 0, got {epochs!r}")
    table = R.with_overrides(rates)
    name, arch, preset_prec = resolve_target(target)
    prec = parse_precision(weight_dtype or preset_prec) if (weight_dtype or preset_prec) else None
    shape = ModelShape.from_arch(arch, prec, name=name)
    hw = load_profile(hardware)
    serve_hw, calibration, notes = hw, f"{hw.name} profile, uncalibrated", []
    if measured is not None:
        m = load_measured(measured)
        tp_m = m.tp or gpus
        fit = fit_profile(shape, hw, tp_m, m, m.context or 2048)
        serve_hw, calibration = fit.profile, f"{hw.name} profile calibrated on {m.source}"
        notes.append(f"calibration: {fit.summary()}")
    regenerate = regenerate or ("local" if fits(shape, hw, 1) else "served")
    capture = CAPTURE_ALIASES.get(capture, capture) or (
        "online" if fits(shape, hw, 1) else ("engine" if fits(shape, hw, gpus) else "streamed"))
    if regenerate not in REGENERATE:
        raise UserError(f"--regenerate must be one of {', '.join(REGENERATE)}, got {regenerate!r}")
    if capture not in CAPTURE:
        raise UserError(f"--capture must be one of {', '.join(CAPTURE)}, got {capture!r}")
    cache_bytes_per_token(shape.hidden_size, cache_dtype)  # validates the dtype
    sizes = Sizes(conversations, turns, tokens_per_turn, float(epochs), max_length, table["reply_share"].value)
    head = eagle3_head_shape(arch, draft_vocab)
    c = _Ctx(name, arch, shape, hw, gpus, sizes, table, head, draft_vocab, ttt_steps, micro_batch_tokens, serve_gpus,
             serve_hw, cache_dtype, calibration, notes)
    curve = fit_curve(R.LEARNING_CURVE)
    tau = curve.at(sizes.train_tokens)
    at_k = tuple(tau_at_k(v, k) for v in (tau.central, tau.low, tau.high))
    stages = [_regeneration(c, regenerate), _capture(c, capture), _cache(c, capture), _training(c, capture),
              _evaluation(c, at_k[0], k, eval_prompts, eval_new_tokens, eval_repeats)]
    stages[1].notes.append("other captures: " + "; ".join(_capture_alternative(c, m) for m in CAPTURE if m != capture))
    return TrainPlan(name, hw, gpus, sizes, stages, tau, k, at_k, curve, table, notes, calibration)


def decode_tokens_per_s(shape: ModelShape, hw: HardwareProfile, tp: int, batch: int, context: int) -> float:
    return batch / step_cost(shape, hw, tp, 1, batch, context).total_s
