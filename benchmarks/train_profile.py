"""EAGLE-3 training throughput on one GPU: the trainer's own steps, in variants, and a kernel profile.

    python benchmarks/train_profile.py --out $OUT (--conversations F | --data DIR) [--steps 16]
        [--variants full,plain-batches,eager-loss] [--profile full]

Uses the token dataset DIR, or builds one from the conversation file F without regeneration
(only throughput is measured here, so the assistant turns need not be the target's), then runs ``train`` for
``--steps`` optimizer steps per variant of the ``full`` preset:

- ``full``: the preset as it is (length-grouped batches, short neighbours joined up to 16,384
  padded tokens, the loss in one-pass Triton kernels, the head's step around its attention
  ``torch.compile``d, the target's forward as CUDA graphs, each step queued before the last is read);
- ``compiled-loss``: ``loss_kernel = "compile"`` (the loss fused by ``torch.compile`` instead);
- ``plain-batches``: ``group_by_length = 0`` (batches of random lengths, padded to the longest);
- ``eager-loss``: ``compile = false``;
- ``eager-head``: ``compile_head = false`` (the head's step in eager kernels);
- ``eager-target``: ``graph_target = false`` (the target's forward launched from Python, not
  replayed as a CUDA graph per batch shape);
- ``flex-attention``: ``ttt_attention = "flex"`` (the unrolled steps' attention in
  ``flex_attention``, only the mask's non-empty blocks);
- ``no-floor``: ``min_batch_tokens = 0`` (short batches not joined);
- ``sync-steps``: ``run_ahead = false`` (the host waits for each step's metrics before it queues
  the next step, instead of one step ahead);
- ``bsN``: the preset with ``batch_size = N``;
- ``tokN``: batches by a budget of ``N`` padded tokens (``batch_tokens = N``);
- ``floorN``: batches of short sequences joined up to ``N`` padded tokens (``min_batch_tokens = N``);
- ``minlenN``: the preset on the examples of at least ``N`` tokens only (a subset of the data
  written once under ``--work``): steps of long sequences, where the attention weighs most;
- several joined by ``+`` (``flex-attention+tok16384``): all their changes.

The first variant of a process pays one-time costs on a GPU (its median came out at less than half
of the same variant's run second: allocator growth, kernel plans): list a throwaway variant
first, or the same one twice. Per variant: median tokens/s (real tokens, the target's forward included) and MFU over the steps
after the first three (warm-up, compilation). ``--profile V`` then builds variant V's trainer,
runs four warm-up steps and profiles the next four optimizer steps alone (no evaluation, no
checkpoint): it reports the wall time per step, the GPU's busy time per step (kernels and
copies; the rest of the wall time the GPU waits for the host) and writes the kernels ranked by
GPU time to ``$OUT/train-profile.txt``, then the same grouped by input shapes (to tell apart the
calls of one operator) to ``$OUT/train-profile-shapes.txt``.
``--write-best F`` writes to F the ``full`` preset with the settings the variants change
(kernels, batching) of the fastest of the variants run on the whole data (by median tokens/s), for a
training run to take with ``--config F``.
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
from outrider.train.prepare import build_dataset
from outrider.train.trainer import train

_CHANGES = {
    "full": {},
    "plain-batches": {"group_by_length": 0},
    "compiled-loss": {"loss_kernel": "compile"},
    "eager-loss": {"compile": False},
    "eager-head": {"compile_head": False},
    "eager-target": {"graph_target": False},
    "flex-attention": {"ttt_attention": "flex"},
    "sync-steps": {"run_ahead": False},
    "no-floor": {"min_batch_tokens": 0},
}


def variant_config(name: str, steps: int) -> TrainConfig:
    """The ``full`` preset for ``steps`` steps with the changes each ``+``-joined part of ``name`` names."""
    cfg = TrainConfig.preset("full").replace(steps=steps, warmup_steps=1, eval_every=10 ** 6, save_every=10 ** 6,
                                             eval_examples=8, time_budget_s=0.0)
    for part in name.split("+"):
        if part in _CHANGES:
            cfg = cfg.replace(**_CHANGES[part])
        elif part[:2] == "bs" and part[2:].isdigit():
            cfg = cfg.replace(batch_size=int(part[2:]))
        elif part[:3] == "tok" and part[3:].isdigit():
            cfg = cfg.replace(batch_tokens=int(part[3:]))
        elif part[:5] == "floor" and part[5:].isdigit():
            cfg = cfg.replace(min_batch_tokens=int(part[5:]))
        elif part[:6] == "minlen" and part[6:].isdigit():
            pass  # the data, not the config: see variant_data
        else:
            raise SystemExit(f"unknown variant {part!r} in {name!r}: use {', '.join(_CHANGES)}, "
                             "bsN, tokN, floorN, minlenN")
    return cfg


def variant_data(name: str, data: str, work: Path) -> str:
    """The data variant ``name`` trains on: ``data``, or its subset of long examples (``minlenN``)."""
    from outrider.train.datasets import subset_dataset

    lengths = [int(part[6:]) for part in name.split("+") if part[:6] == "minlen" and part[6:].isdigit()]
    if not lengths:
        return data
    out = work / f"{Path(data).name}-minlen{lengths[-1]}"  # one subset per data folder and length
    if not (out / "manifest.json").exists():
        subset_dataset(data, out, lengths[-1])
    return str(out)


def run_variant(name: str, steps: int, data: str, work: Path, loaded, position: int = 0) -> dict:
    data = variant_data(name, data, work)
    out = work / f"{position}-{name}"
    t = time.perf_counter()
    rep = train("default", data, str(out), config=variant_config(name, steps), progress=False, loaded_target=loaded)
    wall = time.perf_counter() - t
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("type") == "train"][3:]
    return {"variant": name, "steps": rep.steps, "wall_s": round(wall, 2),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "mfu": statistics.median(r.get("mfu", 0.0) for r in rows),
            "tokens_per_step": statistics.median(r["tokens"] for r in rows)}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_steps(name: str, data: str, work: Path, loaded, table_path: Path, warm: int = 4, steps: int = 4) -> dict:
    """Wall and GPU-busy time of ``steps`` optimizer steps of variant ``name`` after ``warm`` steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from outrider.train import dist
    from outrider.train.trainer import _Trainer

    env = dist.init_from_env(None)
    cfg = variant_config(name, warm + steps)
    data = variant_data(name, data, work.parent)
    tr = _Trainer(env, "default", data, str(work), None, cfg, None, False, None, None, None, False, loaded)
    objective = tr.objective()
    tokens = 0
    with tr.target_capture() as capture:
        tr.capture = capture
        for _ in range(warm):
            tr._train_step(objective)
        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            t = time.perf_counter()
            for _, m, _, _, _ in tr._steps(objective):  # the rest of the steps, queued as a run queues them
                tokens += m["tokens"]
            _sync()
            wall = time.perf_counter() - t
    averages = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA)
    table = averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    table_path.write_text(table)
    shapes = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=40,
                                                                max_name_column_width=50, max_shapes_column_width=90)
    table_path.with_name(table_path.stem + "-shapes.txt").write_text(shapes)
    print(table[:6000])
    return {"variant": name, "steps": steps, "wall_ms_per_step": round(1e3 * wall / steps, 2),
            "gpu_busy_ms_per_step": round(busy_us / 1e3 / steps, 2),
            "tokens_per_s_profiled": round(tokens / wall, 1), "tokens_per_step": tokens / steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--conversations", help="ShareGPT/OpenAI JSON to tokenise (no regeneration) into --data")
    ap.add_argument("--data", default="/tmp/prof/data")
    ap.add_argument("--work", default="/tmp/prof")
    ap.add_argument("--max-conversations", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--variants", default="full,plain-batches,eager-loss")
    ap.add_argument("--profile", default="full", help="variant to profile ('' = none)")
    ap.add_argument("--write-best", default=None, help="write the fastest variant's training config here")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work)
    cuda = torch.cuda.is_available()
    results: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
    if a.conversations:
        t = time.perf_counter()
        rep = build_dataset("default", a.conversations, a.data, max_conversations=a.max_conversations,
                            max_length=1024, progress=False)
        results["data"] = {"seconds": round(time.perf_counter() - t, 1), **rep.to_dict()}
    loaded = load_model("default", device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32")
    results["variants"] = []
    for name in [v for v in a.variants.split(",") if v]:
        results["variants"].append(run_variant(name, a.steps, a.data, work, loaded, len(results["variants"])))
        print(json.dumps(results["variants"][-1]), flush=True)
        atomic_write_json(out / "train_profile.json", results)
    if a.write_best and results["variants"]:
        same_data = [v for v in results["variants"] if "minlen" not in v["variant"]]  # comparable tokens/s only
        best = max(same_data or results["variants"], key=lambda v: v["tokens_per_s"])
        flags = variant_config(best["variant"], a.steps)
        kept = ("loss_kernel", "compile_head", "graph_target", "ttt_attention", "compile", "group_by_length",
                "batch_size", "batch_tokens", "min_batch_tokens")
        cfg = TrainConfig.preset("full").replace(**{key: getattr(flags, key) for key in kept})
        cfg.save(a.write_best)
        results["best"] = {"variant": best["variant"], "config": a.write_best}
    if a.profile:
        results["profile"] = profile_steps(a.profile, a.data, work / "profiled", loaded, out / "train-profile.txt")
        print(json.dumps(results["profile"]), flush=True)
    atomic_write_json(out / "train_profile.json", results)
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
