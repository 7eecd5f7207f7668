"""Lockstep batches: round counts against exact cases and a simulation, and the planner's use of them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from outrider.errors import UserError
from outrider.plan.acceptance import Acceptance, expected_tokens_chain
from outrider.plan.batching import (
    RoundsModel,
    RowProfile,
    RowSpread,
    measured_spread,
    multiplier_for,
    rounds_cdf,
    scaled,
    spread_from_bench,
    uniform_spread,
    x_pmf,
)
from outrider.plan.planner import plan

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "history" / "results"


def test_round_distribution_exact_cases():
    assert x_pmf([0.7, 0.5]) == pytest.approx([0.3, 0.35, 0.35])
    assert x_pmf([0.7, 0.5]) @ np.arange(1, 4) == pytest.approx(expected_tokens_chain([0.7, 0.5]))
    always = rounds_cdf([1.0], 5)  # two tokens a round: 5 tokens take 3 rounds
    assert list(always) == [0.0, 0.0, 0.0, 1.0]
    never = rounds_cdf([0.0, 0.0], 4)  # one token a round
    assert list(never) == [0.0, 0.0, 0.0, 0.0, 1.0]
    rates = [0.6, 0.4]
    long = rounds_cdf(rates, 2000)
    assert np.sum(1 - long) == pytest.approx(2000 / expected_tokens_chain(rates), rel=0.01)  # renewal: N / tau


def test_multiplier_matches_tau():
    rates = (0.68, 0.49, 0.37, 0.30, 0.24)
    for tau in (1.5, 2.4, 3.0, 4.5):
        c = multiplier_for(rates, tau)
        assert expected_tokens_chain(scaled(rates, c)) == pytest.approx(tau, abs=1e-6)


def test_expected_max_matches_a_simulation():
    """E[max of B rows' rounds], rows drawn from a two-profile spread, against 20,000 simulated batches."""
    rates, k, n, batch = (0.7, 0.5, 0.3), 3, 20, 8
    spread = RowSpread((RowProfile(1.4, 20), RowProfile(0.6, 12, weight=2.0)), 20, "test")
    model = RoundsModel(Acceptance(rates), k, spread, n)
    rng = np.random.default_rng(0)
    trials = 20_000
    kind = rng.choice(2, size=(trials, batch), p=[1 / 3, 2 / 3])  # [trials, batch]: each row's profile
    rounds = np.zeros((trials, batch))
    for row in (0, 1):  # tokens per round from the rates as the model normalised them: X = 1 + draws
        x = 1 + rng.choice(k + 1, size=(trials, batch, n), p=x_pmf(model.row_rates[row]))  # [trials, batch, n]
        need = (np.cumsum(x, axis=2) < model.lengths[row]).sum(axis=2) + 1  # rounds to reach the length
        rounds = np.where(kind == row, need, rounds)
    sims = rounds.max(axis=1)
    assert model.at(batch).rounds == pytest.approx(np.mean(sims), rel=0.01)
    assert model.at(batch).ar_steps == pytest.approx(20 - 8 * (2 / 3) ** batch, rel=1e-9)  # 20 unless all rows are 12


def test_lockstep_against_continuous():
    acc = Acceptance.from_tau(2.26, 3)
    uni = RoundsModel(acc, 3, uniform_spread(128), 128)
    spread = RoundsModel(acc, 3, measured_spread(), 128)
    assert uni.at(1).rounds == pytest.approx(128 / 2.26, rel=0.02)
    assert spread.at(1).tokens_per_round == pytest.approx(2.26, rel=0.03)  # normalised to the pooled tau
    by_b = [spread.at(b).rounds for b in (1, 4, 16, 64)]
    assert all(x < y for x, y in zip(by_b, by_b[1:]))  # the slowest of more rows is slower
    assert 60 < uni.at(64).rounds < 70 and 70 < spread.at(64).rounds < 90  # the docstring's worked example
    assert spread.at(64, "continuous").rounds == spread.at(1, "continuous").rounds
    with pytest.raises(UserError, match="batching"):
        spread.at(4, "paged")
    with pytest.raises(UserError, match="batch"):
        spread.at(0)


def test_lockstep_reproduces_the_h200_batches():
    """The recorded batch 4/16/64 runs (their own step costs) from the 30-prompt spread: within 10 %,
    where the bound without the lockstep term is 13-52 % too high."""
    recs = json.loads((RESULTS / "h200-bench-batches-5.json").read_text())
    recs = recs["records"] if isinstance(recs, dict) else recs
    spread = measured_spread()
    for r in recs:
        model = RoundsModel(Acceptance.from_record(r), r["k"], spread, r["max_new_tokens"])
        br = model.at(r["batch_size"])
        t_round = r["verify_step_ms"] + r["draft_step_ms"]
        predicted = br.ar_steps * r["ar_step_ms"] / (br.rounds * t_round)
        bound = r["tau"] * r["ar_step_ms"] / t_round
        assert abs(predicted / r["decode_speedup_vs_ar"] - 1) < 0.10, r["batch_size"]
        assert bound / r["decode_speedup_vs_ar"] - 1 > 0.12


def test_spread_from_bench_rows():
    rates = (0.68, 0.49, 0.37, 0.30, 0.24)
    sp = spread_from_bench(rates, [2.0, 4.0, 3.0], [10, 40, 5], 128, "three prompts")
    assert [p.tokens for p in sp.rows] == [20, 128, 15]  # tau x steps, capped
    assert sp.lengths_for(64) == [10, 64, 8]
    assert expected_tokens_chain(scaled(rates, sp.rows[1].multiplier)) == pytest.approx(4.0, abs=1e-6)
    with pytest.raises(UserError):
        spread_from_bench(rates, [2.0], [], 128, "bad")


def test_planner_lockstep_batching(tmp_path):
    console = Console(file=io.StringIO(), width=160)
    cont = plan("default", "h200", batches=[1, 64], tau=3.0, tau_k=5, ks=[5], console=console)
    lock = plan("default", "h200", batches=[1, 64], tau=3.0, tau_k=5, ks=[5], console=console, batching="lockstep")
    c = {p.batch: p for p in cont.predictions if p.method == "eagle3"}
    lk = {p.batch: p for p in lock.predictions if p.method == "eagle3"}
    assert lk[1].speedup == pytest.approx(c[1].speedup, rel=0.05)
    assert lk[64].speedup < 0.9 * c[64].speedup
    assert lk[64].batching == "lockstep" and lk[64].tokens_per_round < 3.0
    # per-prompt rows of a batch-1 bench are the spread when the acceptance file has them
    rec = {"method": "eagle3", "k": 5, "tau": 3.0, "accept_rate_per_pos": [0.7, 0.5, 0.4, 0.3, 0.2],
           "batch_size": 1, "max_new_tokens": 128, "tau_per_batch": [2.0, 3.0, 4.0, 3.5],
           "row_steps_per_batch": [40, 30, 30, 20]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([rec]))
    out = io.StringIO()
    plan("default", "h200", batches=[8], acceptance=str(path), ks=[5], batching="lockstep",
         console=Console(file=out, width=200))
    assert "bench.json (4 prompts at batch 1)" in out.getvalue()
    with pytest.raises(UserError, match="--batching"):
        plan("default", "h200", batching="paged", console=console)


def test_batch_benchmark_comparisons():
    """``plan.validate``'s comparisons (``benchmarks/planner_batches.py``) on records shaped as ``bench`` writes them."""
    from outrider.plan import validate as pb
    one = {"method": "eagle3", "k": 3, "batch_size": 1, "max_new_tokens": 32, "tau": 2.5,
           "accept_rate_per_pos": [0.7, 0.5, 0.4], "tau_per_batch": [1.5, 3.0, 2.5, 3.5],
           "row_steps_per_batch": [20, 8, 13, 5], "ar_step_ms": 1.0, "verify_step_ms": 1.2, "draft_step_ms": 0.3,
           "step_ms": 1.5, "decode_speedup_vs_ar": 1.6}
    two = dict(one, batch_size=2, ar_step_ms=1.1, verify_step_ms=1.4, draft_step_ms=0.4, step_ms=1.8,
               decode_speedup_vs_ar=1.3)
    records = {1: one, 2: two}
    rows = {r["batch"]: r for r in pb.lockstep_rows(records, 32, ar_chunk=8)}
    lengths = [30, 24, 32, 18]  # tau x steps, capped at 32
    assert rows[2]["lockstep_ar_steps"] == 32 + 32  # the longer row of each pair, in whole chunks of 8, capped
    assert rows[1]["lockstep_ar_steps"] == 32 + 24 + 32 + 24
    assert rows[2]["lockstep_rounds"] > rows[1]["lockstep_rounds"] / 2  # pairs wait for their slower row
    assert rows[1]["lockstep_speedup"] == pytest.approx(
        rows[1]["lockstep_ar_steps"] * 1.0 / (rows[1]["lockstep_rounds"] * 1.5))
    assert sum(lengths) / rows[1]["lockstep_rounds"] == pytest.approx(2.5, rel=0.1)
    planned = pb.planner_rows(records, "lockstep", 32)
    assert set(planned) == {1, 2} and all(v > 0 for v in planned.values())


def test_calibration_keeps_the_draft_round_per_batch():
    from outrider.plan.calibrate import calibrate
    from outrider.plan.cost_model import DraftSpec, ModelShape, draft_round_cost
    from outrider.plan.hardware import load_profile
    from outrider.plan.presets import SMOLLM2_135M

    shape, hw = ModelShape.from_arch(SMOLLM2_135M), load_profile("h200")
    recs = [{"method": "eagle3", "k": 3, "batch_size": b, "ar_step_ms": ar, "verify_step_ms": v, "draft_step_ms": d}
            for b, ar, v, d in ((64, 4.6, 7.7, 1.4), (4, 1.6, 2.5, 1.0))]
    cal = calibrate(recs, shape, hw)
    assert cal.draft_round_s == {"eagle3": {3: pytest.approx(1.0e-3)}}  # the smallest batch's for other batches
    table = cal.draft_round_by_batch["eagle3"]
    assert table == {(3, 64): pytest.approx(1.4e-3), (3, 4): pytest.approx(1.0e-3)}
    spec = DraftSpec("eagle3", None, 0, cal.draft_round_s["eagle3"], table)
    assert draft_round_cost(spec, hw, 1, 3, 64, 512).total_s == pytest.approx(1.4e-3)
    assert draft_round_cost(spec, hw, 1, 3, 16, 512).total_s == pytest.approx(1.0e-3)
