"""The planner against a measured batch sweep: predictions for the batches a bench run formed.

Contract: ``records`` maps batch size -> an ``outrider bench`` record of one method and k (batch 1
included: its per-prompt figures give each row's acceptance and reply length). ``lockstep_rows``
applies the lockstep rounds model to the very batches the run formed, with the run's measured step
costs; ``planner_rows`` asks the planner, calibrated on the records' step times. The measured
speedups are the records' own. Used by ``benchmarks/planner_batches.py``.
"""

from __future__ import annotations

import io
import math
import tempfile
from pathlib import Path

from rich.console import Console

from outrider.plan.acceptance import Acceptance
from outrider.plan.batching import RoundsModel, spread_from_bench
from outrider.plan.planner import plan
from outrider.records import write_records


def lockstep_rows(records: dict[int, dict], max_new: int, ar_chunk: int) -> list[dict]:
    """Per batch size: the lockstep model on the batches the run actually formed, with measured step costs.
    ``ar_chunk``: plain decoding's device steps per host check (``SpecEngine.AR_CHUNK``)."""
    one = records[1]
    acc = Acceptance.from_record(one)
    k = one["k"]
    spread = spread_from_bench(acc.rates, one["tau_per_batch"], one["row_steps_per_batch"], max_new, "batch 1")
    model = RoundsModel(acc, k, spread, max_new)
    chunk = ar_chunk
    rows = []
    for b, r in sorted(records.items()):
        n = len(model.lengths)
        groups = [list(range(i, min(i + b, n))) for i in range(0, n, b)]
        rounds = sum(model.of_rows(g).rounds for g in groups)
        ar_steps = sum(min(max_new, chunk * math.ceil(max(model.lengths[i] for i in g) / chunk)) for g in groups)
        pred = ar_steps * r["ar_step_ms"] / (rounds * r["step_ms"])
        rows.append({"batch": b, "lockstep_rounds": rounds, "lockstep_ar_steps": ar_steps, "lockstep_speedup": pred})
    return rows


def planner_rows(records: dict[int, dict], batching: str, max_new: int) -> dict[int, float]:
    """Per batch size: the planner's speedup, its acceptance from the batch-1 record, calibrated on them all."""
    with tempfile.TemporaryDirectory() as tmp:
        acc, cal = Path(tmp) / "batch1.json", Path(tmp) / "all.json"
        write_records(acc, [records[1]])
        write_records(cal, list(records.values()))
        result = plan("default", "h200", acceptance=str(acc), calibrate=str(cal), ks=[records[1]["k"]],
                      batches=sorted(records), batching=batching, new_tokens=max_new, console=Console(file=io.StringIO()))
    return {p.batch: p.speedup for p in result.predictions if p.method == records[1]["method"]}
