"""Predicted against measured speedup: the planner calibrated on a bench run's step times only.

    python benchmarks/planner_check.py RESULTS.json [--hardware h200] [--batching lockstep] [--out check.json]

RESULTS.json holds bench records (a list, or an object with ``records``, as
``gpu_session.py train-bench`` writes). Records are grouped by how the target step ran
(``compiled``); per group the planner is calibrated on ``ar_step_ms``, ``verify_step_ms`` and
``draft_step_ms`` (never a speedup), takes acceptance from the same records, and its predicted
speedup (of decoding) is set against each record's measured ``decode_speedup_vs_ar`` (prefill
excluded), or ``speedup_vs_ar`` in records written before that field existed. Our engine runs a
batch in lockstep (``--batching lockstep``, the default: a batch lasts as long as its slowest
row; ``continuous`` leaves that term out).
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

from rich.console import Console

from outrider.fsutil import atomic_write_json
from outrider.plan.planner import plan
from outrider.records import read_records, write_records


def check(records: list[dict], hardware: str, batching: str = "lockstep") -> list[dict]:
    rows = []
    groups: dict[bool, list[dict]] = {}
    for r in records:
        groups.setdefault(bool(r.get("compiled")), []).append(r)
    for compiled, recs in sorted(groups.items()):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "records.json"
            write_records(path, recs)
            ks = sorted({r["k"] for r in recs})
            batches = sorted({r.get("batch_size", 1) for r in recs})
            new = max(r.get("max_new_tokens", 128) for r in recs)
            result = plan("default", hardware, acceptance=str(path), calibrate=str(path), ks=ks, batches=batches,
                          console=Console(file=io.StringIO()), batching=batching, new_tokens=new)
        for r in recs:
            pred = next(p for p in result.predictions
                        if p.method == r["method"] and p.k == r["k"] and p.batch == r.get("batch_size", 1))
            measured = r.get("decode_speedup_vs_ar", r["speedup_vs_ar"])  # decode only, where recorded
            rows.append({"compiled": compiled, "method": r["method"], "k": r["k"], "batch": r.get("batch_size", 1),
                         "tau": r["tau"],
                         "measured": measured, "predicted": pred.speedup, "error": pred.speedup / measured - 1.0,
                         "calibration": result.calibration.summary() if result.calibration else ""})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--batching", default="lockstep", choices=["lockstep", "continuous"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    records = read_records(a.results)
    rows = check(records, a.hardware, a.batching)
    seen = set()
    for row in rows:
        if row["calibration"] not in seen:
            seen.add(row["calibration"])
            print(f"[{'compiled' if row['compiled'] else 'eager kernels'}] {row['calibration']}")
    print("| target step | method | batch | k | tau | measured | predicted | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {'compiled' if row['compiled'] else 'eager'} | {row['method']} | {row['batch']} | {row['k']} | {row['tau']:.2f} | "
              f"{row['measured']:.2f}x | {row['predicted']:.2f}x | {100 * row['error']:+.1f}% |")
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {100 * worst:.1f}% over {len(rows)} configurations")
    if a.out:
        atomic_write_json(a.out, rows)


if __name__ == "__main__":
    main()
