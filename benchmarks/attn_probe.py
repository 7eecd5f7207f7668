"""Which attention kernel a cached engine step should use, on the GPU; no weights needed.

    python benchmarks/attn_probe.py --out $OUT [--compiled]

On a randomly initialised model of the default model's shape (``step_probe.py``): the replay
time of the target's CUDA graph at widths 1 and k+1 over 1024 and 2048 cache slots, with the
model's SDPA (PyTorch's choice, then each backend forced) and with ``outrider.slot_attention``;
a kernel table of one eager step per width; then (``--compiled``) the same through the engine's
``torch.compile``-fused step and the engine's per-round spans (AR, EAGLE-3 k chained drafts) with the
target's steps captured with each attention. Writes ``$OUT/attn-probe.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from step_probe import REPLAYS, _timed, default_shape_model, random_head
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from outrider import kv_cache
from outrider.decode.engine import SpecEngine
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.decode.slot_attention import using_slot_attention
from outrider.fsutil import atomic_write_json

KERNELS = {"sdpa": None, "sdpa-math": SDPBackend.MATH, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
           "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "slots": "slots"}


def _context(model, kernel: str):
    if kernel == "slots":
        return using_slot_attention(model)
    if KERNELS[kernel] is None:
        return contextlib.nullcontext()
    return sdpa_kernel([KERNELS[kernel]])


def replay_times(model, kernel: str, widths, lengths, compile: bool) -> dict:
    out = {}
    for S in lengths:
        lm = kv_cache.CachedLM(model, 1, S, graphs=True, compile=compile)
        ids = torch.randint(100, 40000, (1, 200), device="cuda")
        lm.forward(ids, query_valid=torch.ones_like(ids, dtype=torch.bool))
        lm.commit(torch.ones_like(ids, dtype=torch.bool))
        for n in widths:
            try:
                t = time.perf_counter()
                with _context(model, kernel):
                    lm.forward(ids[:, :n])
                torch.cuda.synchronize()
                build = time.perf_counter() - t
                ms = _timed(lm._graphs[n][0].replay, REPLAYS)
                out[f"S{S}-n{n}"] = round(ms, 4)
                print(f"  {kernel} S={S} n={n}: {ms:.3f} ms (built {build:.1f} s)", flush=True)
            except RuntimeError as e:
                out[f"S{S}-n{n}"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"  {kernel} S={S} n={n}: failed {str(e)[:200]}", flush=True)
        lm.close()
    return out


def kernel_table(model, n: int, kernel: str) -> str:
    lm = kv_cache.CachedLM(model, 1, 1024, read_len="max")
    ids = torch.randint(100, 40000, (1, 200), device="cuda")
    lm.forward(ids, query_valid=torch.ones_like(ids, dtype=torch.bool))
    lm.commit(torch.ones_like(ids, dtype=torch.bool))
    with _context(model, kernel):
        for _ in range(3):
            lm.forward(ids[:, :n])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            lm.forward(ids[:, :n])
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70)


def engine_spans(model, head, k: int, target_kernel: str) -> dict:
    prompt = torch.randint(100, 40000, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    for name, prop in [("ar", None), ("eagle3", Eagle3Proposer(head, model))]:
        eng = SpecEngine(model, prop, k=k, graphs=True, compile=True,
                         attention="slots" if target_kernel == "slots" else "model")
        with _context(model, target_kernel):
            eng.generate([prompt], 2 * (k + 1) * 9)
        rs = [eng.generate([prompt], 128) for _ in range(3)]
        steps = sum(r.steps for r in rs)
        out[name] = {"step_ms": round(1e3 * sum(r.decode_s for r in rs) / steps, 4),
                     "verify_ms": round(1e3 * sum(r.verify_s for r in rs) / steps, 4),
                     "draft_ms": round(1e3 * sum(r.propose_s for r in rs) / steps, 4)}
        print(f"  engine target {target_kernel} {name}: {out[name]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--kernels", default="sdpa,sdpa-math,sdpa-efficient,sdpa-cudnn,slots")
    ap.add_argument("--compiled", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = default_shape_model()
    widths = (1, a.k + 1)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "eager_graphs": {}}
    for kernel in a.kernels.split(","):
        res["eager_graphs"][kernel] = replay_times(model, kernel, widths, (1024, 2048), compile=False)
        atomic_write_json(out / "attn-probe.json", res)
    tables = []
    for kernel in ("sdpa", "slots"):
        for n in widths:
            tables.append(f"### {kernel} n={n}\n" + kernel_table(model, n, kernel))
    (out / "attn-kernels.txt").write_text("\n".join(tables))
    print("\n".join(tables)[:6000], flush=True)
    if a.compiled:
        head = random_head(model)
        torch._dynamo.reset()
        res["compiled_graphs"] = {"slots": replay_times(model, "slots", (1, 2, a.k + 1), (1024, 2048), compile=True)}
        atomic_write_json(out / "attn-probe.json", res)
        res["engine"] = {}
        for target_kernel in ("slots", "sdpa"):
            torch._dynamo.reset()
            res["engine"][target_kernel] = engine_spans(model, head, a.k, target_kernel)
            atomic_write_json(out / "attn-probe.json", res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
