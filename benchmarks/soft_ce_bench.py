"""The TTT loss's soft cross-entropy alone on one GPU: eager, torch.compile'd and the Triton kernels.

    python benchmarks/soft_ce_bench.py --out $OUT [--rows 16000] [--teacher-rows 19480] [--vocab 32000]

Times the forward and forward + backward of each implementation on bf16 logits [rows, vocab]
scored against gathered rows of a bf16 teacher [teacher-rows, vocab] (the shapes of one TTT step
of the ``full`` preset), with CUDA events, median of 20 after 5 warm-ups; the Triton kernels also
under a few (BLOCK, num_warps) settings. Reports milliseconds and the bytes each pass must move
(logits + teacher rows read; gradient written) per second. Writes ``$OUT/soft_ce_bench.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from cuda_timing import median_ms  # benchmarks/cuda_timing.py, next to this script

from outrider.fsutil import atomic_write_json
from outrider.train.loop import soft_ce
from outrider.train.loop.ttt import fused_soft_cross_entropy, soft_cross_entropy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=16000)
    ap.add_argument("--teacher-rows", type=int, default=19480)
    ap.add_argument("--vocab", type=int, default=32000)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    N, M, V = a.rows, a.teacher_rows, a.vocab
    logits = (2 * torch.randn(N, V, device="cuda", generator=g)).bfloat16().requires_grad_(True)  # [N, V]
    teacher = (3 * torch.randn(M, V, device="cuda", generator=g)).bfloat16()  # [M, V]
    rows = torch.randperm(M, device="cuda", generator=g)[:N]  # [N]
    gb_fwd = (2 * N * V * 2) / 1e9  # logits + teacher rows, bf16
    gb_bwd = gb_fwd + N * V * 2 / 1e9  # and the gradient written
    ref = soft_cross_entropy(logits, teacher, rows)[0]
    impls = {"eager": soft_cross_entropy, "compile": fused_soft_cross_entropy()}
    if soft_ce.available():
        impls["triton"] = soft_ce.soft_cross_entropy_triton
    settings = [(soft_ce._BLOCK, soft_ce._WARPS), (2048, 4), (1024, 4), (4096, 4), (8192, 16)]
    results = []

    def measure(name: str, fn) -> None:
        ce = fn(logits, teacher, rows)[0]
        fwd = median_ms(lambda: fn(logits, teacher, rows), reps=20, warm=5)
        both = median_ms(lambda: torch.autograd.grad(fn(logits, teacher, rows)[0].sum(), logits), reps=20, warm=5)
        row = {"impl": name, "forward_ms": round(fwd, 3), "forward_backward_ms": round(both, 3),
               "forward_GBps": round(gb_fwd / fwd * 1e3, 1), "backward_GBps": round(gb_bwd / max(both - fwd, 1e-6) * 1e3, 1),
               "max_abs_err_vs_eager": float((ce - ref).abs().max())}
        results.append(row)
        print(json.dumps(row), flush=True)

    for name, fn in impls.items():
        if name != "triton":
            measure(name, fn)
            continue
        default = (soft_ce._BLOCK, soft_ce._WARPS)
        for block, warps in settings:
            soft_ce._BLOCK, soft_ce._WARPS = block, warps
            measure(f"triton BLOCK={block} warps={warps}", fn)
        soft_ce._BLOCK, soft_ce._WARPS = default
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": N, "teacher_rows": M,
           "vocab": V, "results": results}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(a.out) / "soft_ce_bench.json", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
