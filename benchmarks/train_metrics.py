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
import json
from pathlib import Path

from outrider.errors import UserError
from outrider.train.loop.metrics import summarise_log


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
    try:
        out = [summarise_log(p, a.after) for p in a.metrics]
    except UserError as e:
        raise SystemExit(str(e)) from None
    for s in out:
        _print(s)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
