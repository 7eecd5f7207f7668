"""EAGLE-3 training throughput on one GPU: the trainer's own steps, in variants, and a kernel profile.

    python benchmarks/train_profile.py --out $OUT --conversations F [--data DIR] [--steps 16]
        [--variants full,plain-batches,eager-loss] [--profile full]

Builds a token dataset from the conversation file F without regeneration (only throughput is
measured here, so the assistant turns need not be the target's), then runs ``train`` for
``--steps`` optimizer steps per variant of the ``full`` preset:

- ``full``: the preset as it is (length-grouped batches, loss fused by ``torch.compile``);
- ``plain-batches``: ``group_by_length = 0`` (batches of random lengths, padded to the longest);
- ``eager-loss``: ``compile = false``;
- ``bsN``: the preset with ``batch_size = N``.

Per variant: median tokens/s (real tokens, the target's forward included) and MFU over the steps
after the first three (warm-up, compilation). ``--profile V`` then runs four steps of variant V
under ``torch.profiler`` and writes the kernels ranked by GPU time to ``$OUT/train-profile.txt``.
Writes ``$OUT/train_profile.json`` and prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from outrider.config import TrainConfig
from outrider.fsutil import atomic_write_json
from outrider.models import load_model
from outrider.train.data import build_dataset
from outrider.train.trainer import train


def variant_config(name: str, steps: int) -> TrainConfig:
    cfg = TrainConfig.preset("full").replace(steps=steps, warmup_steps=1, eval_every=10 ** 6, save_every=10 ** 6,
                                             eval_examples=8, time_budget_s=0.0)
    if name == "plain-batches":
        return cfg.replace(group_by_length=0)
    if name == "eager-loss":
        return cfg.replace(compile=False)
    if name.startswith("bs"):
        return cfg.replace(batch_size=int(name[2:]))
    if name != "full":
        raise SystemExit(f"unknown variant {name!r}")
    return cfg


def run_variant(name: str, steps: int, data: str, work: Path, loaded) -> dict:
    out = work / name
    t = time.perf_counter()
    rep = train("default", data, str(out), config=variant_config(name, steps), progress=False, loaded_target=loaded)
    wall = time.perf_counter() - t
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("type") == "train"][3:]
    return {"variant": name, "steps": rep.steps, "wall_s": round(wall, 2),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "mfu": statistics.median(r.get("mfu", 0.0) for r in rows),
            "tokens_per_step": statistics.median(r["tokens"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--conversations", required=True, help="ShareGPT/OpenAI JSON to tokenise (no regeneration)")
    ap.add_argument("--data", default="/tmp/prof/data")
    ap.add_argument("--work", default="/tmp/prof")
    ap.add_argument("--max-conversations", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--variants", default="full,plain-batches,eager-loss")
    ap.add_argument("--profile", default="full", help="variant to profile ('' = none)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work)
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    t = time.perf_counter()
    rep = build_dataset("default", a.conversations, a.data, max_conversations=a.max_conversations, max_length=1024,
                        progress=False)
    results["data"] = {"seconds": round(time.perf_counter() - t, 1), **rep.to_dict()}
    loaded = load_model("default", device="cuda", dtype="bfloat16")
    results["variants"] = []
    for name in [v for v in a.variants.split(",") if v]:
        results["variants"].append(run_variant(name, a.steps, a.data, work, loaded))
        print(json.dumps(results["variants"][-1]), flush=True)
        atomic_write_json(out / "train_profile.json", results)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        run_variant(a.profile, 4, a.data, work / "warm", loaded)  # compiled code ready before profiling
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            train("default", a.data, str(work / "profiled"), config=variant_config(a.profile, 4), progress=False,
                  loaded_target=loaded)
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
        (out / "train-profile.txt").write_text(table)
        print(table[:6000])
    atomic_write_json(out / "train_profile.json", results)
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
