"""GPU benchmark of the default model: transformers generate vs our engine (eager and CUDA
graphs), n-gram and EAGLE-3 for k = 1..7, per-step costs. One device call; prints a table per
section and ends with one JSON line; writes every record to --out.

    python benchmarks/gpu_bench.py --out $OUT/gpu_bench.json [--head DIR] [--prompts F]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from outrider.bench.local import bench, load_prompts
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.fsutil import atomic_write_json
from outrider.models import load_model


def time_hf(model, prompts, max_new, eos, pad):
    from outrider.bench.local import hf_generate

    hf_generate(model, prompts[:1], 1, 8, eos, pad)
    outs, s = hf_generate(model, prompts, 1, max_new, eos, pad)
    return sum(len(o) for o in outs) / s, outs


def time_hf_compiled(model, prompts, max_new, eos, pad, budget_s=240):
    """transformers' best: StaticCache + torch.compile(reduce-overhead) through generate."""
    t0 = time.perf_counter()
    try:
        model.generation_config.cache_implementation = "static"
        fwd = model.forward
        model.forward = torch.compile(fwd, mode="reduce-overhead", fullgraph=False)
        from outrider.bench.local import hf_generate

        for _ in range(2):
            hf_generate(model, prompts[:1], 1, max_new, eos, pad)
        if time.perf_counter() - t0 > budget_s:
            return None, "compile warm-up over budget"
        outs, s = hf_generate(model, prompts, 1, max_new, eos, pad)
        return sum(len(o) for o in outs) / s, outs
    except Exception as e:  # report, keep the rest of the benchmark
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        model.forward = fwd
        model.generation_config.cache_implementation = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--head", default=None)
    ap.add_argument("--prompts", default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--hf-compiled", action="store_true")
    ap.add_argument("--skip-baselines", action="store_true", help="skip HF generate and the eager engine")
    a = ap.parse_args()
    model, tok = load_model("default", device="cuda", dtype="bfloat16")
    eos = eos_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    prompts = load_prompts(tok, a.prompts, a.num_prompts)
    results = {"device": torch.cuda.get_device_name(0), "records": []}
    hf_tps, hf_outs = (None, None) if a.skip_baselines else time_hf(model, prompts, a.max_new_tokens, eos, pad)
    results["hf_generate_tokens_per_s"] = hf_tps
    for graphs in () if a.skip_baselines else (False, True):
        eng = SpecEngine(model, None, eos_ids=eos, graphs=graphs)
        eng.generate(prompts[:1], 8)
        t = time.perf_counter()
        outs = [eng.generate([p], a.max_new_tokens) for p in prompts]
        eng.sync()
        s = time.perf_counter() - t
        n = sum(r.new_tokens for r in outs)
        key = "ours_graphs" if graphs else "ours_eager"
        results[f"{key}_tokens_per_s"] = n / s
        results[f"{key}_step_ms"] = 1e3 * sum(r.verify_s for r in outs) / sum(r.steps for r in outs)
        results[f"{key}_agreement_with_hf"] = sum(o.tokens[0] == h for o, h in zip(outs, hf_outs)) / len(outs)
        print(key, f"{n / s:.1f} tok/s", f"step {results[f'{key}_step_ms']:.3f} ms", flush=True)
    print("hf generate", hf_tps, "tok/s", flush=True)
    if a.hf_compiled:
        tps, note = time_hf_compiled(model, prompts, a.max_new_tokens, eos, pad)
        results["hf_compiled_tokens_per_s"] = tps
        results["hf_compiled_note"] = note if tps is None else "StaticCache + torch.compile(reduce-overhead)"
        print("hf compiled", tps, note if tps is None else "", flush=True)
    ks = [int(x) for x in a.ks.split(",")]
    methods = [("ngram", None)] + ([("eagle3", a.head)] if a.head else [])
    for batch in [int(x) for x in a.batches.split(",")]:
        for method, draft in methods:
            for k in ks:
                r = bench("default", method, draft=draft, k=k, num_prompts=len(prompts), prompts=a.prompts,
                          max_new_tokens=a.max_new_tokens, batch_size=batch, loaded=(model, tok), graphs=True)
                results["records"].append(r)
                print(f"b{batch} {method} k={k} tau {r['tau']:.2f} {r['tokens_per_s']:.1f} tok/s "
                      f"AR {r['ar_tokens_per_s']:.1f} speedup {r['speedup_vs_ar']:.2f}x verify {r['verify_step_ms']:.3f} ms "
                      f"propose {r['propose_step_ms']:.3f} ms AR step {r['ar_step_ms']:.3f} ms agree {r['greedy_agreement']:.2f}",
                      flush=True)
                atomic_write_json(a.out, results)
    atomic_write_json(a.out, results)
    print(json.dumps({k: v for k, v in results.items() if k != "records"}))


if __name__ == "__main__":
    main()
