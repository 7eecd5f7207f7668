"""Layer-streamed capture on one GPU: a Kimi-K2.5-wide target bigger than the budget, and the default model.

    python benchmarks/stream_bench.py --out DIR [--layers auto] [--gpu-memory 80] [--tokens-per-pass 131072]
        [--passes 2] [--packing padded|packed] [--states auto|device|host] [--default-model default|PATH|none]
        [--json FILE] [--keep]

1. Writes a DeepSeek-V3-shaped checkpoint with Kimi-K2.5's widths (hidden 7168, vocabulary 163840,
   MLA ranks q 1536 / kv 512, rope 64, nope 128, v 128, 64 heads, 384 routed experts of width 2048,
   8 per token, 1 shared expert, a first dense layer of width 18432) as Kimi-K2.5 ships it: a
   ``kimi_k25`` wrapper config, ``language_model.``-prefixed names, one shard per layer with an
   index, routed experts in compressed-tensors pack-quantized INT4 (group 32, bf16 scales), the rest
   bf16. Random values are written straight in the packed format (generated on the GPU); as many
   MoE layers as the free disk and host memory allow (``--layers``: MoE layers; the dense one
   comes on top).
2. Measures the link: pinned host-to-device copies of 1 GiB (the peak the streamer can reach).
3. Measures compute: a bf16 GEMM 8192^3, and the routed experts of one layer (transformers'
   ``DeepseekV3Experts``, its default grouped_mm) on ``--expert-tokens`` tokens routed uniformly.
4. Streams the checkpoint (``outrider.train.states.stream.StreamedTarget``, ``--gpu-memory`` GB, well
   below its dequantized size) over ``--passes`` passes of ``--tokens-per-pass`` tokens (random
   ids, lengths uniform in [256, 2048]) after one warm-up pass. The streamer's memory plan
   (``outrider.memory_plan``: weights, states, the measured working set of attention and the MoE
   dispatch) chooses the chunks and where the states live, or refuses in one line (exit 2) before
   loading. Reports per pass: tokens/s against the roofline (the pass's checkpoint bytes at the
   measured link rate, or its matmul FLOPs at the measured GEMM rate, whichever is slower),
   checkpoint GB/s read into pinned buffers and copied to the device, the share of that loading
   hidden behind compute, the compute and dequantization seconds, the planned and the measured
   peak device memory, and the efficiency max(loading, compute) / wall (goal >= 0.8).
5. Measures cold disk reads (one shard written back, dropped from the page cache, read in parallel
   pieces) and predicts Kimi-K2.5 (61 layers, ~595 GB) per 100 M tokens on this GPU from those rates:
   with its weights in host memory, and read from this disk each pass.
6. The default model: streamed capture tokens/s against the plain in-memory forward over the same
   chunks, and the largest absolute difference of every aux state and the final one (bf16).

Prints the figures and writes a JSON record (device, date, commit, command, figures). Runs on the
CPU at a tiny size (``--shape tiny --device cpu``) for tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cuda_timing import median_ms  # noqa: E402 (benchmarks/cuda_timing.py, next to this script)

from outrider.errors import UserError  # noqa: E402
from outrider.fsutil import atomic_write_json  # noqa: E402

KIMI_QUANT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "observer": "minmax"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*"],
    "kv_cache_scheme": None}
SHAPES = {
    "kimi": dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                 num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384, num_experts_per_tok=8,
                 n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
                 q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 first_k_dense_replace=1, max_position_embeddings=262144, rope_theta=50000.0,
                 rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                               "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                 rms_norm_eps=1e-5, hidden_act="silu", num_nextn_predict_layers=0, tie_word_embeddings=False),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                 n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                 q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 first_k_dense_replace=1, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                 hidden_act="silu", num_nextn_predict_layers=0, tie_word_embeddings=False),
}
KIMI_LAYERS = 61  # 1 dense + 60 MoE
PREFIX = "language_model.model."
GB = 1e9


# --------------------------------------------------------------------------------------------
# The checkpoint, written in the packed format


def layer_tensors(c: dict, i: int) -> list[tuple[str, str, tuple[int, ...], tuple]]:
    """(name, safetensors dtype, shape, fill) of decoder layer ``i``; fill: ("normal", std) |
    ("const", value) | ("int4",) | ("shape", rows, cols)."""
    H, heads = c["hidden_size"], c["num_attention_heads"]
    qk, v = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    p = f"{PREFIX}layers.{i}."
    out = [
        (p + "input_layernorm.weight", "BF16", (H,), ("const", 1.0)),
        (p + "post_attention_layernorm.weight", "BF16", (H,), ("const", 1.0)),
        (p + "self_attn.q_a_proj.weight", "BF16", (c["q_lora_rank"], H), ("normal", H ** -0.5)),
        (p + "self_attn.q_a_layernorm.weight", "BF16", (c["q_lora_rank"],), ("const", 1.0)),
        (p + "self_attn.q_b_proj.weight", "BF16", (heads * qk, c["q_lora_rank"]), ("normal", c["q_lora_rank"] ** -0.5)),
        (p + "self_attn.kv_a_proj_with_mqa.weight", "BF16", (c["kv_lora_rank"] + c["qk_rope_head_dim"], H),
         ("normal", H ** -0.5)),
        (p + "self_attn.kv_a_layernorm.weight", "BF16", (c["kv_lora_rank"],), ("const", 1.0)),
        (p + "self_attn.kv_b_proj.weight", "BF16", (heads * (c["qk_nope_head_dim"] + v), c["kv_lora_rank"]),
         ("normal", c["kv_lora_rank"] ** -0.5)),
        (p + "self_attn.o_proj.weight", "BF16", (H, heads * v), ("normal", (heads * v) ** -0.5)),
    ]
    if i < c["first_k_dense_replace"]:
        inter = c["intermediate_size"]
        return out + [(p + "mlp.gate_proj.weight", "BF16", (inter, H), ("normal", H ** -0.5)),
                      (p + "mlp.up_proj.weight", "BF16", (inter, H), ("normal", H ** -0.5)),
                      (p + "mlp.down_proj.weight", "BF16", (H, inter), ("normal", inter ** -0.5))]
    E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    shared = inter * c["n_shared_experts"]
    out += [(p + "mlp.gate.weight", "F32", (E, H), ("normal", H ** -0.5)),
            (p + "mlp.gate.e_score_correction_bias", "F32", (E,), ("const", 0.0)),
            (p + "mlp.shared_experts.gate_proj.weight", "BF16", (shared, H), ("normal", H ** -0.5)),
            (p + "mlp.shared_experts.up_proj.weight", "BF16", (shared, H), ("normal", H ** -0.5)),
            (p + "mlp.shared_experts.down_proj.weight", "BF16", (H, shared), ("normal", shared ** -0.5))]
    for e in range(E):
        for proj, (rows, cols) in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
            q = f"{p}mlp.experts.{e}.{proj}."
            # int4 values uniform in [-8, 7] (std ~4.6): scale so that the weight's std is ~1/sqrt(cols)
            out += [(q + "weight_packed", "I32", (rows, cols // 8), ("int4",)),
                    (q + "weight_scale", "BF16", (rows, cols // 32), ("const", 1 / (4.6 * math.sqrt(cols)))),
                    (q + "weight_shape", "I64", (2,), ("shape", rows, cols))]
    return out


ITEM = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8}
TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32, "I64": torch.int64}


def _fill(dtype: str, n: int, fill: tuple, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    kind = fill[0]
    if kind == "normal":
        return (torch.randn(n, device=device, generator=gen) * fill[1]).to(TORCH[dtype])
    if kind == "const":
        return torch.full((n,), fill[1], dtype=TORCH[dtype], device=device)
    if kind == "int4":
        return torch.randint(-(1 << 31), (1 << 31) - 1, (n,), dtype=torch.int32, device=device, generator=gen)
    return torch.tensor(fill[1:], dtype=torch.int64)


def write_safetensors(path: Path, tensors: list, device: torch.device, gen: torch.Generator) -> int:
    """A safetensors file of generated tensors, written piece by piece; returns its bytes."""
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, _ in tensors:
        n = math.prod(shape) * ITEM[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    piece = 1 << 26  # elements generated at a time
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, dtype, shape, fill in tensors:
            total = math.prod(shape)
            for start in range(0, total, piece):
                t = _fill(dtype, min(piece, total - start), fill, device, gen).cpu()
                f.write(memoryview(t.view(torch.uint8).numpy()))
    return 8 + len(raw) + at


def kimi_like_config(shape: str, layers: int) -> dict:
    text = dict(SHAPES[shape], architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2",
                num_hidden_layers=layers, quantization_config=KIMI_QUANT, torch_dtype="bfloat16",
                bos_token_id=1, eos_token_id=2)
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
            "vision_config": {"model_type": "moonvit"}, "torch_dtype": "bfloat16"}


def layer_bytes(c: dict, i: int) -> int:
    return sum(math.prod(s) * ITEM[d] for _, d, s, _ in layer_tensors(c, i))


def dequantized_layer_bytes(c: dict, i: int) -> int:
    """Layer ``i`` with its INT4 routed experts in bf16 (what the device holds while it computes)."""
    n = c["n_routed_experts"] * 3 * c["hidden_size"] * c["moe_intermediate_size"]  # routed expert weights
    int4 = n // 2 + n // 32 * 2 + c["n_routed_experts"] * 3 * 16  # packed, scales, shapes
    return layer_bytes(c, i) - int4 + 2 * n if i >= c["first_k_dense_replace"] else layer_bytes(c, i)


def write_checkpoint(out: Path, shape: str, layers: int, device: torch.device) -> dict:
    """The Kimi-like checkpoint in ``out`` (reused when ``out`` already holds this one)."""
    config = kimi_like_config(shape, layers)
    marker = out / "bench.json"
    if marker.exists() and json.loads(marker.read_text()).get("config") == config:
        return json.loads(marker.read_text())
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    c, gen = config["text_config"], torch.Generator(device=device).manual_seed(0)
    t0 = time.perf_counter()
    V, H = c["vocab_size"], c["hidden_size"]
    files = [("embed", [(PREFIX + "embed_tokens.weight", "BF16", (V, H), ("normal", 1.0))])]
    files += [(f"layer{i:02d}", layer_tensors(c, i)) for i in range(layers)]
    files += [("head", [(PREFIX + "norm.weight", "BF16", (H,), ("const", 1.0)),
                        ("language_model.lm_head.weight", "BF16", (V, H), ("normal", H ** -0.5))])]
    weight_map, total = {}, 0
    for k, (tag, tensors) in enumerate(files):
        name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        total += write_safetensors(out / name, tensors, device, gen)
        weight_map.update({t[0]: name for t in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    info = {"config": config, "bytes": total, "write_s": time.perf_counter() - t0}
    marker.write_text(json.dumps(info))
    return info


def auto_layers(out: Path, shape: str, cap: int = 5) -> int:
    """MoE layers that fit 85 % of the free disk and 45 % of the host memory (page cache)."""
    c = kimi_like_config(shape, 2)["text_config"]
    fixed = 2 * c["vocab_size"] * c["hidden_size"] * 2 + layer_bytes(c, 0)
    moe = layer_bytes(c, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free + (sum(p.stat().st_size for p in out.glob("*")) if out.exists() else 0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cap, int((min(0.85 * free, 0.45 * ram) - fixed) // moe)))


# --------------------------------------------------------------------------------------------
# Rates


def h2d_peak(device: torch.device, nbytes: int = 1 << 30) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = median_ms(lambda: dev.copy_(host, non_blocking=True))
    d2h = median_ms(lambda: host.copy_(dev, non_blocking=True))
    return {"h2d_gbps": nbytes / h2d / 1e6, "d2h_gbps": nbytes / d2h / 1e6, "bytes": nbytes}


def disk_read_gbps(path: Path, threads: int = 8, piece: int = 64 << 20) -> float | None:
    """Cold reads of one file: written back (fsync), dropped from the page cache, read in parallel
    pieces as the streamer reads; GB/s (None where the page cache cannot be dropped)."""
    from concurrent.futures import ThreadPoolExecutor

    if not hasattr(os, "posix_fadvise"):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        buffers = [bytearray(piece) for _ in range(threads)]

        def read(k: int) -> int:
            done = 0
            for start in range(k * piece, size, threads * piece):
                done += os.preadv(fd, [memoryview(buffers[k])[: min(piece, size - start)]], start)
            return done

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, range(threads)))
        return total / (time.perf_counter() - t0) / GB
    finally:
        os.close(fd)


def gemm_rate(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n ** 3 / median_ms(lambda: a @ b) / 1e9  # TFLOP/s


def expert_rate(folder: Path, device: torch.device, tokens: int) -> dict:
    """Routed experts of one layer (the streamed skeleton's own ``DeepseekV3Experts``, its default
    implementation) on ``tokens`` uniformly routed tokens."""
    from outrider.train.states.stream import build_skeleton, text_config

    config, _ = text_config(folder)
    experts = build_skeleton(config, torch.bfloat16).model.layers[config.first_k_dense_replace].mlp.experts
    experts = experts.to_empty(device=device)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    E, k, H = config.n_routed_experts, config.num_experts_per_tok, config.hidden_size
    x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16)
    idx = torch.rand(tokens, E, device=device).topk(k, dim=-1).indices  # [tokens, k] uniform routing
    w = torch.full((tokens, k), 1.0 / k, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        ms = median_ms(lambda: experts(x, idx, w))
    flops = 2 * tokens * k * 3 * H * config.moe_intermediate_size
    impl = getattr(experts.config, "_experts_implementation", None)
    experts = None  # freed before the cache is emptied
    torch.cuda.empty_cache()
    return {"tokens": tokens, "ms": ms, "tflops": flops / ms / 1e9, "implementation": impl}


def moe_layer_flops_per_token(c: dict, context: float, dense: bool = False) -> float:
    """Matmul FLOPs per token of one MoE layer (``dense``: the dense first layer): projections, routed
    and shared experts (the dense MLP), attention at an average ``context`` (keys per query)."""
    H, heads = c["hidden_size"], c["num_attention_heads"]
    qk, v = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    proj = (c["q_lora_rank"] * H + heads * qk * c["q_lora_rank"] + (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * H
            + heads * (c["qk_nope_head_dim"] + v) * c["kv_lora_rank"] + H * heads * v)
    experts = (c["num_experts_per_tok"] + c["n_shared_experts"]) * 3 * H * c["moe_intermediate_size"]
    if dense:
        return 2 * (proj + 3 * H * c["intermediate_size"]) + 2 * heads * (qk + v) * context
    return 2 * (proj + experts + c["n_routed_experts"] * H) + 2 * heads * (qk + v) * context


def roofline(run: dict, c: dict, layers: int, context: float, link_gbps: float | None,
             gemm_tflops: float | None) -> dict:
    """A pass's ideal: its checkpoint bytes at the link's rate or its matmul FLOPs at the GEMM rate,
    whichever takes longer (the loader overlaps the two); tokens/s there and this pass's share of it."""
    dense = min(layers, c["first_k_dense_replace"])
    flops = run["tokens"] * (dense * moe_layer_flops_per_token(c, context, dense=True)
                             + (layers - dense) * moe_layer_flops_per_token(c, context))
    copy_s = run["nbytes"] / (link_gbps * GB) if link_gbps else None
    compute_s = flops / (gemm_tflops * 1e12) if gemm_tflops else None
    ideal = max(x for x in (copy_s, compute_s, 0.0) if x is not None)
    tps = run["tokens"] / ideal if ideal else None
    return {"copy_s": copy_s, "compute_s": compute_s, "flops": flops, "bound": "copy" if (copy_s or 0) >= (compute_s or 0)
            else "compute", "roofline_tokens_per_s": tps, "share": run["tokens_per_s"] / tps if tps else None}


# --------------------------------------------------------------------------------------------
# Streaming


def random_examples(n_tokens: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out, total = [], 0
    while total < n_tokens:
        n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), n_tokens - total)
        out.append(torch.randint(3, vocab, (n,), generator=g).tolist())
        total += n
    return out


def stream_run(folder: Path, a: argparse.Namespace, device: torch.device, vocab: int, aux: tuple) -> dict:
    from outrider.train.states.stream import StreamedTarget

    if device.type == "cuda":
        torch.cuda.empty_cache()  # the rate measurements' cached blocks: the budget starts empty
        torch.cuda.reset_peak_memory_stats(device)
    runs = []
    with StreamedTarget(folder, aux, device=device, dtype="bfloat16" if device.type == "cuda" else "float32",
                        gpu_memory=a.gpu_memory, tokens_per_pass=a.tokens_per_pass, packing=a.packing,
                        states_on=a.states, max_chunk_tokens=a.chunk_tokens, attention_memory=a.attention_memory) as st:
        need = st.weights_need()
        st.states(random_examples(min(a.tokens_per_pass, 4 * a.hi), vocab, a.lo, a.hi, seed=99))  # warm-up
        for p in range(a.passes):
            exs = random_examples(a.tokens_per_pass, vocab, a.lo, a.hi, seed=p)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            st.states(exs)
            wall = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
            s = st.stats[-1]
            units = s.units
            moe = [u for u in units if u.name.startswith("layers.") and int(u.name.split(".")[1]) >= 1]
            cuda = device.type == "cuda"
            unit_compute = [(u.ms("compute0", "compute1") / 1e3 if cuda else u.compute_s) for u in moe]
            unit_build = [(u.ms("compute0", "built") / 1e3 if cuda else u.build_s) for u in moe]
            unit_copy = [u.ms("copy0", "copy1") / 1e3 for u in moe] if cuda else [0.0] * len(moe)
            load = max(s.read_s, s.copy_s)  # the loader reads unit k+1 while unit k's copy runs
            runs.append({**s.to_dict(), "call_wall_s": wall, "moe_layer_bytes": moe[0].nbytes if moe else 0,
                         "moe_compute_s": statistics.median(unit_compute) if moe else 0.0,
                         "moe_build_s": statistics.median(unit_build) if moe else 0.0,
                         "moe_copy_s": statistics.median(unit_copy) if moe else 0.0,
                         "read_gbps": s.nbytes / s.read_s / GB if s.read_s else None,
                         "h2d_gbps": s.nbytes / s.copy_s / GB if s.copy_s else None,
                         "load_bound_s": load, "compute_bound_s": s.compute_s,
                         "planned_peak_gb": s.planned_bytes / GB, "peak_allocated_gb": peak,
                         "efficiency": max(load, s.compute_s) / s.wall_s if s.wall_s else None})
        out = {"weights_need_gb": need / GB, "budget_gb": st.budget / GB if math.isfinite(st.budget) else None,
               "chunks_per_pass": runs[-1]["chunks"], "working_set": st.working.describe(), "runs": runs}
    if device.type == "cuda":
        out["peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / GB
    return out


def predict_kimi(c: dict, run: dict, tokens_per_pass: int, moe_bytes: int, dense_bytes: int, embed_bytes: int,
                 load_gbps: float, disk_gbps: float | None) -> dict:
    """Kimi-K2.5 (1 dense + 60 MoE layers) per 100 M tokens, from this run's per-layer rates: its
    weights read at this run's loading rate (host memory holds the whole checkpoint), or at the
    disk's cold rate when it does not (595 GB against this box's host memory)."""
    total_bytes = embed_bytes + dense_bytes + (KIMI_LAYERS - 1) * moe_bytes
    per_token = (run["moe_compute_s"] - run["moe_build_s"]) / run["tokens"]  # one MoE layer, per token
    out = {"kimi_bytes_gb": total_bytes / GB, "load_gbps": load_gbps, "disk_gbps": disk_gbps}
    for T in sorted({tokens_per_pass, 262144, 524288}):
        compute = (KIMI_LAYERS - 1) * (run["moe_build_s"] + per_token * T)  # the dense layer and embedding aside
        entry = {"compute_s_per_pass": compute, "states_gb_per_pass": T * c["hidden_size"] * 2 * 5 / GB}
        for tag, rate in (("cached", load_gbps), ("disk", min(load_gbps, disk_gbps) if disk_gbps else None)):
            if rate is None:
                continue
            load = total_bytes / (rate * GB)
            ideal = max(load, compute)
            entry[tag] = {"load_s_per_pass": load, "hours_per_100M_ideal": ideal * 1e8 / T / 3600,
                          "hours_per_100M_expected": ideal / max(run["efficiency"] or 1.0, 1e-9) * 1e8 / T / 3600}
        out[str(T)] = entry
    return out


# --------------------------------------------------------------------------------------------
# The default model: streamed against the plain forward


def default_compare(spec: str, a: argparse.Namespace, device: torch.device) -> dict:
    from outrider.models import load_model, resolve
    from outrider.train.states.stream import StreamedTarget

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _ = load_model(spec, device=device, dtype=dtype, with_tokenizer=False)
    L, V = model.config.num_hidden_layers, model.config.vocab_size
    aux = (2, L // 2, L - 3)
    exs = random_examples(a.default_tokens, V, 128, 1024, seed=7)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with StreamedTarget(resolve(spec), aux, device=device, dtype=dtype, tokens_per_pass=a.default_tokens,
                        states_on="device", out_device=device) as st:
        st.states(exs[:8])  # warm-up
        t0 = time.perf_counter()
        streamed = st.states(exs)
        sync()
        stream_s = time.perf_counter() - t0
        chunks, _ = st.plan([len(x) for x in exs])

    def plain():
        res = {}
        with torch.no_grad():
            for c in chunks:
                ids = torch.full((c.rows, c.width), st.pad_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for r, i in enumerate(c.examples):
                    ids[r, : c.lengths[r]] = torch.tensor(exs[i])
                    mask[r, : c.lengths[r]] = 1
                hs = model.model(ids.to(device), attention_mask=mask.to(device), use_cache=False,
                                 output_hidden_states=True).hidden_states
                for r, i in enumerate(c.examples):
                    n = c.lengths[r]
                    res[i] = (torch.cat([hs[j][r, :n] for j in aux], -1), hs[-1][r, :n])
        return res

    plain()  # warm-up
    sync()
    t0 = time.perf_counter()
    ref = plain()
    sync()
    plain_s = time.perf_counter() - t0
    tokens = sum(map(len, exs))
    H = model.config.hidden_size
    diffs = {f"aux{j}": 0.0 for j in aux} | {"final": 0.0}
    for i, (x, f) in enumerate(streamed):
        rx, rf = ref[i]
        for k, j in enumerate(aux):
            diffs[f"aux{j}"] = max(diffs[f"aux{j}"], float((x[:, k * H:(k + 1) * H] - rx[:, k * H:(k + 1) * H]).abs().max()))
        diffs["final"] = max(diffs["final"], float((f - rf).abs().max()))
    return {"tokens": tokens, "examples": len(exs), "chunks": len(chunks), "streamed_s": stream_s, "plain_s": plain_s,
            "streamed_tokens_per_s": tokens / stream_s, "plain_tokens_per_s": tokens / plain_s,
            "max_abs_diff": diffs, "bit_identical": all(v == 0.0 for v in diffs.values()),
            "stream_stats": st.stats[-1].to_dict()}


# --------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the checkpoint (reused when it matches)")
    ap.add_argument("--shape", default="kimi", choices=sorted(SHAPES))
    ap.add_argument("--layers", default="auto", help="MoE layers (the dense first layer comes on top), or auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-memory", type=float, default=None, help="streaming budget in GB (default: 80 on CUDA)")
    ap.add_argument("--tokens-per-pass", type=int, default=131072)
    ap.add_argument("--chunk-tokens", type=int, default=None, help="padded tokens per chunk (default: the streamer's)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--packing", default="padded", choices=["padded", "packed"])
    ap.add_argument("--states", default="auto", choices=["auto", "device", "host"])
    ap.add_argument("--attention-memory", default="math", choices=["math", "fused"],
                    help="price SDPA's working set at its math path (an upper bound) or at CUDA's fused kernels")
    ap.add_argument("--lo", type=int, default=256, help="shortest example")
    ap.add_argument("--hi", type=int, default=2048, help="longest example")
    ap.add_argument("--expert-tokens", type=int, default=32768)
    ap.add_argument("--default-model", default="default", help="default | a model folder | none")
    ap.add_argument("--default-tokens", type=int, default=262144)
    ap.add_argument("--json", default=None, help="the record (default: OUT/../stream_bench.json)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (to rerun without writing it)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if a.gpu_memory is None and cuda:
        a.gpu_memory = 80.0
    out = Path(a.out).expanduser()
    layers = (auto_layers(out, a.shape) if a.layers == "auto" else int(a.layers)) + 1
    t0 = time.perf_counter()
    record: dict = {"benchmark": "stream_bench", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "commit": _commit(), "command": " ".join([sys.executable, *sys.argv]),
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                    "shape": a.shape, "layers": layers, "tokens_per_pass": a.tokens_per_pass,
                    "gpu_memory_gb": a.gpu_memory, "packing": a.packing, "states": a.states,
                    "attention_memory": a.attention_memory}
    info = write_checkpoint(out, a.shape, layers, device)
    c = info["config"]["text_config"]
    record["checkpoint"] = {"bytes_gb": info["bytes"] / GB, "write_s": info["write_s"],
                            "moe_layer_gb": layer_bytes(c, 1) / GB,
                            "moe_layer_dequantized_gb": dequantized_layer_bytes(c, 1) / GB}
    print(f"checkpoint: {layers} layers ({layers - 1} MoE), {info['bytes'] / GB:.1f} GB "
          f"(written in {info['write_s']:.0f} s); one MoE layer {record['checkpoint']['moe_layer_gb']:.2f} GB INT4, "
          f"{record['checkpoint']['moe_layer_dequantized_gb']:.1f} GB dequantized")
    if cuda:
        record["link"] = h2d_peak(device)
        record["gemm_tflops"] = gemm_rate(device)
        record["experts"] = expert_rate(out, device, a.expert_tokens)
        print(f"link: pinned H2D {record['link']['h2d_gbps']:.1f} GB/s, D2H {record['link']['d2h_gbps']:.1f} GB/s; "
              f"bf16 GEMM 8192^3 {record['gemm_tflops']:.0f} TFLOP/s; routed experts ({record['experts']['tokens']} "
              f"tokens, {record['experts']['implementation']}) {record['experts']['tflops']:.0f} TFLOP/s")
    shards = sorted(out.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    record["disk_read_gbps"] = disk_read_gbps(shards[-1])
    if record["disk_read_gbps"]:
        print(f"disk: cold reads of {shards[-1].name} at {record['disk_read_gbps']:.1f} GB/s")
    aux = (1, max(1, layers // 2), layers - 1) if layers >= 3 else (0, 1, 1)
    record["stream"] = stream_run(out, a, device, c["vocab_size"], tuple(sorted(set(aux))))
    print(f"memory plan: budget {record['stream']['budget_gb'] or math.inf:.1f} GB, weights {record['stream']['weights_need_gb']:.1f} GB, "
          f"working set per layer step: {record['stream']['working_set']}")
    ctx = (a.lo + a.hi) / 4  # mean keys per query for lengths uniform in [lo, hi]
    for k, r in enumerate(record["stream"]["runs"]):
        r["roofline"] = roofline(r, c, layers, ctx, record.get("link", {}).get("h2d_gbps"), record.get("gemm_tflops"))
        q = r["roofline"]
        if q["roofline_tokens_per_s"]:
            print(f"pass {k}: {r['tokens_per_s']:,.0f} tokens/s against a roofline of {q['roofline_tokens_per_s']:,.0f} "
                  f"tokens/s ({q['bound']}-bound: copy {q['copy_s'] or 0:.2f} s, compute {q['compute_s'] or 0:.2f} s) = "
                  f"{100 * q['share']:.0f} %; device memory planned {r['planned_peak_gb']:.1f} GB, peak allocated "
                  + (f"{r['peak_allocated_gb']:.1f} GB" if r["peak_allocated_gb"] is not None else "n/a"))
        print(f"pass {k}: {r['tokens']} tokens ({r['padded_tokens']} padded, {r['chunks']} chunks, states on "
              f"{r['states_on']}) in {r['wall_s']:.2f} s = {r['tokens_per_s']:,.0f} tokens/s; read "
              f"{r['nbytes'] / GB:.1f} GB in {r['read_s']:.2f} s, copied in {r['copy_s']:.2f} s"
              + (f" ({r['h2d_gbps']:.1f} GB/s)" if r["h2d_gbps"] else "")
              + f"; compute {r['compute_s']:.2f} s (building weights {r['build_s']:.2f} s); exposed loading "
              f"{r['exposed_s']:.2f} s, hidden {100 * r['hidden_share']:.0f} %; efficiency "
              f"max(load, compute)/wall {r['efficiency']:.2f}")
    if "peak_allocated_gb" in record["stream"]:
        print(f"device memory: peak {record['stream']['peak_allocated_gb']:.1f} GB allocated, budget "
              f"{record['stream']['budget_gb']:.0f} GB, weights need {record['stream']['weights_need_gb']:.1f} GB")
    run = record["stream"]["runs"][-1]
    load_gbps = run["nbytes"] / max(run["read_s"], run["copy_s"], 1e-9) / GB
    if layers >= 2:
        H, V = c["hidden_size"], c["vocab_size"]
        kimi = dict(SHAPES["kimi"]) if a.shape == "kimi" else c
        record["kimi_prediction"] = predict_kimi(kimi, run, a.tokens_per_pass, layer_bytes(c, 1), layer_bytes(c, 0),
                                                 V * H * 2, load_gbps, record.get("disk_read_gbps"))
        flops = moe_layer_flops_per_token(c, ctx)
        per_token = (run["moe_compute_s"] - run["moe_build_s"]) / run["tokens"]
        record["moe_layer_tflops"] = flops / per_token / 1e12 if per_token > 0 else None
        for T, p in record["kimi_prediction"].items():
            if T.isdigit():
                for tag in ("cached", "disk"):
                    if tag in p:
                        q = p[tag]
                        print(f"Kimi-K2.5 at {int(T):,} tokens/pass, weights {'in host memory' if tag == 'cached' else 'from disk'}: "
                              f"load {q['load_s_per_pass']:.1f} s, compute {p['compute_s_per_pass']:.1f} s per pass -> "
                              f"{q['hours_per_100M_ideal']:.2f} h per 100 M tokens ideal, "
                              f"{q['hours_per_100M_expected']:.2f} h at this run's efficiency "
                              f"(states {p['states_gb_per_pass']:.0f} GB per pass)")
        print(f"one MoE layer computes at {record['moe_layer_tflops'] or 0:.0f} TFLOP/s "
              f"({flops / 1e9:.2f} GFLOP/token), builds its weights in {run['moe_build_s'] * 1e3:.0f} ms")
    if a.default_model != "none":
        record["default_model"] = default_compare(a.default_model, a, device)
        d = record["default_model"]
        print(f"default model: streamed {d['streamed_tokens_per_s']:,.0f} tokens/s vs plain "
              f"{d['plain_tokens_per_s']:,.0f} tokens/s ({d['tokens']} tokens, {d['chunks']} chunks); max |diff| "
              + ", ".join(f"{k} {v:.3g}" for k, v in d["max_abs_diff"].items()))
    record["wall_s"] = time.perf_counter() - t0
    path = Path(a.json) if a.json else out.parent / "stream_bench.json"
    atomic_write_json(path, record)
    print(f"wrote {path} ({record['wall_s']:.0f} s)")
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)
    return record


def _commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # the memory plan's refusal, a bad checkpoint: one line
        print(f"stream_bench: error: {e}", file=sys.stderr)
        sys.exit(2)
