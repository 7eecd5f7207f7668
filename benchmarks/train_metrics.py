"""A training run's throughput and learning curve from its ``metrics.jsonl``, the way RESULTS.md reports them.

    python benchmarks/train_metrics.py METRICS.jsonl[.gz] [METRICS2.jsonl[.gz] ...] [--after 100] [--json F]

Per file: the median step (tokens/s, MFU counting the attention products, MFU by the weights'
products alone), the share of steps at >= 20 % MFU, and the steady steps (after ``--after``
steps: compilation and first-step allocations excluded) as one figure, MFU weighted by each
step's time; then the steady steps by real tokens per step (count, time-weighted MFU, median step
time) and the evaluations (step, tokens seen, simulated and walked tau, step-0 accuracy).
A step's time is its tokens over its tokens/s, as the trainer measured it (from the end of the
step before as the host saw it; with steps queued ahead, ``ahead`` in the records, a step short
of device work takes the host's time to launch the next, so the time-weighted steady figure is
the sound one; the median step, the share of steps at >= 20 % and the buckets by size are only
roughly so). The share of steady steps queued ahead is printed too.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

BUCKETS = (0, 8_000, 10_000, 12_000, 14_000, 20_000, 30_000)


def _time(r: dict) -> float:
    return r["tokens"] / r["tokens_per_s"]


def _weighted(rows: list[dict], key: str) -> float:
    total = sum(_time(r) for r in rows)
    return sum(r.get(key, 0.0) * _time(r) for r in rows) / total if total else 0.0


def summarise(path: str | Path, after: int = 100) -> dict:
    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode()
    rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    train = [r for r in rows if r.get("type") == "train"]
    if len(train) <= after:
        raise SystemExit(f"{path}: {len(train)} training steps, not more than --after {after}")
    steady = train[after:]
    out = {
        "file": str(path), "steps": len(train), "step_time_s": round(sum(_time(r) for r in train), 1),
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in train)),
        "median_mfu": round(statistics.median(r.get("mfu", 0.0) for r in train), 4),
        "median_mfu_weights": round(statistics.median(r.get("mfu_weights", r.get("mfu", 0.0)) for r in train), 4),
        "share_at_20pct": round(sum(r.get("mfu", 0.0) >= 0.2 for r in train) / len(train), 3),
        "median_tokens_per_step": round(statistics.median(r["tokens"] for r in train)),
        "steady": {"after_step": after, "time_s": round(sum(_time(r) for r in steady), 1),
                   "mfu": round(_weighted(steady, "mfu"), 5),
                   "tokens_per_s": round(sum(r["tokens"] for r in steady) / sum(_time(r) for r in steady)),
                   "ahead_share": round(sum(bool(r.get("ahead")) for r in steady) / len(steady), 3)},
        "by_tokens": [], "evals": [],
    }
    edges = list(BUCKETS) + [float("inf")]
    for lo, hi in zip(edges, edges[1:]):
        part = [r for r in steady if lo <= r["tokens"] < hi]
        if part:
            out["by_tokens"].append({"from": lo, "to": None if hi == float("inf") else hi, "steps": len(part),
                                     "mfu": round(_weighted(part, "mfu"), 5),
                                     "median_ms": round(1e3 * statistics.median(_time(r) for r in part), 1)})
    seen = 0
    for r in rows:
        if r.get("type") == "train":
            seen += r["tokens"]
        elif r.get("type") == "eval":
            out["evals"].append({"step": r["step"], "tokens_m": round(seen / 1e6, 1), "sim_tau": r.get("sim_tau_k"),
                                 "walk_tau": r.get("walk_tau_k"), "acc0": (r.get("per_step_acc") or [None])[0]})
    return out


def _print(s: dict) -> None:
    st = s["steady"]
    print(f"{s['file']}: {s['steps']} steps, {s['step_time_s']} s of steps; median step {s['median_tokens_per_s']:,} "
          f"tokens/s, MFU {100 * s['median_mfu']:.1f} % ({100 * s['median_mfu_weights']:.1f} % weights), "
          f"{100 * s['share_at_20pct']:.0f} % of steps >= 20 %; after step {st['after_step']}: MFU "
          f"{100 * st['mfu']:.1f} % time-weighted over {st['time_s']} s, {st['tokens_per_s']:,} tokens/s, "
          f"{100 * st['ahead_share']:.0f} % of them queued ahead")
    for b in s["by_tokens"]:
        print(f"  {b['from']:>6,}-{'' if b['to'] is None else format(b['to'], ','):<8} tokens: {b['steps']:5d} steps, "
              f"MFU {100 * b['mfu']:5.1f} %, "
              f"median {b['median_ms']} ms")
    for e in s["evals"]:
        print(f"  eval step {e['step']:5d} ({e['tokens_m']}M tokens): tau sim {e['sim_tau']}, walked {e['walk_tau']}, "
              f"acc0 {e['acc0']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", nargs="+")
    ap.add_argument("--after", type=int, default=100, help="steps left out of the steady figures")
    ap.add_argument("--json", default=None, help="also write the summaries here")
    a = ap.parse_args()
    out = [summarise(p, a.after) for p in a.metrics]
    for s in out:
        _print(s)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
