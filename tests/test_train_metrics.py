"""``metrics.summarise_log``: the figures RESULTS.md quotes for a training run, on a known file;
``Throughput``: the rates a run reports as it goes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from outrider.errors import UserError
from outrider.train.loop.metrics import Throughput, summarise_log


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_steady_mfu_is_weighted_by_step_time(tmp_path):
    # step 1 (100 s, left out as warm-up), then a 0.1 s step at 20 % and a 0.3 s step at 10 %
    rows = [{"type": "train", "step": 1, "tokens": 100000, "tokens_per_s": 1000.0, "mfu": 0.01, "mfu_weights": 0.01},
            {"type": "train", "step": 2, "tokens": 9000, "tokens_per_s": 90000.0, "mfu": 0.2, "mfu_weights": 0.19},
            {"type": "eval", "step": 2, "sim_tau_k": 2.5, "walk_tau_k": 2.4, "per_step_acc": [0.6, 0.5]},
            {"type": "train", "step": 3, "tokens": 36000, "tokens_per_s": 120000.0, "mfu": 0.1, "mfu_weights": 0.09}]
    s = summarise_log(_write(tmp_path / "m.jsonl", rows), after=1)
    assert s["steps"] == 3 and s["median_tokens_per_s"] == 90000 and s["median_mfu"] == 0.1
    assert s["median_mfu_weights"] == 0.09 and s["step_time_s"] == 100.4
    assert s["steady"]["time_s"] == 0.4 and s["steady"]["mfu"] == pytest.approx((0.2 * 0.1 + 0.1 * 0.3) / 0.4)
    assert s["steady"]["tokens_per_s"] == 112500 and s["share_at_20pct"] == pytest.approx(1 / 3, abs=1e-3)
    assert [(b["from"], b["to"], b["steps"], b["median_ms"]) for b in s["by_tokens"]] == \
        [(8000, 10000, 1, 100.0), (30000, None, 1, 300.0)]
    assert s["evals"] == [{"step": 2, "tokens_m": 0.1, "sim_tau": 2.5, "walk_tau": 2.4, "acc0": 0.6}]
    json.loads(json.dumps(s, allow_nan=False))  # plain JSON: no Infinity
    assert s["steady"]["ahead_share"] == 0.0
    with pytest.raises(UserError, match="not more than --after 3"):
        summarise_log(tmp_path / "m.jsonl", after=3)
    # a gzipped copy reads the same; the steps queued ahead are counted
    rows[-1]["ahead"] = True
    (tmp_path / "m.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    z = summarise_log(tmp_path / "m.jsonl.gz", after=1)
    assert z["steady"]["ahead_share"] == 0.5 and z["steady"]["mfu"] == s["steady"]["mfu"]


def test_the_bars_rate_pools_recent_steps():
    """On the CPU a step queued ahead runs at its launch, so the host counts its seconds in the step
    before and the last step reads ~0 s: the bar's rate pools the last steps (the final step's own
    rate, the figure the bar showed before, read a million tokens a second on a 230 tokens/s run)."""
    rate = Throughput(None, 1, window=4)
    for dt in (1.0, 1.0, 2.0, 1e-6):  # the last step's seconds were counted in the third
        rate.add({"tokens": 100}, dt, 0.0, 0.0, 0.0)
    assert rate.recent() == pytest.approx(400 / 4.000001)
    assert rate.tokens_per_s() == pytest.approx(400 / 4.000001)
    rate.add({"tokens": 100}, 1.0, 0.0, 0.0, 0.0)  # the window drops the first step
    assert rate.recent() == pytest.approx(400 / 4.000001)
    assert rate.tokens_per_s() == pytest.approx(500 / 5.000001)
