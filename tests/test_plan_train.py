"""``plan --train``: stage figures from their formulas, Kimi-K2.5 plans on 8 x RTX PRO 6000 and on one
H200, the learning-curve fit, rates from a file, the command line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from outrider.cli import main
from outrider.errors import UserError
from outrider.plan import rates as R
from outrider.plan.learning import fit_curve
from outrider.plan.train_plan import (
    cache_bytes_per_token,
    head_flops_per_token,
    target_flops_per_token,
    train_plan,
)
from outrider.plan.train_report import render_markdown, to_json

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "history" / "results"


def test_learning_curve_fit_recovers_a_known_curve():
    pts = [R.CurvePoint(n * 1e6, 3.5 - 5.0 * n ** -0.5, f"p{i}") for i, n in enumerate((10, 30, 60, 120, 250, 500))]
    curve = fit_curve(pts)
    assert (curve.best.tau_inf, curve.best.a, curve.best.b) == pytest.approx((3.5, 5.0, 0.5), abs=1e-6)
    est = curve.at(100e6)
    assert est.low <= est.central <= est.high and not est.extrapolated
    assert curve.at(5e9).extrapolated
    with pytest.raises(UserError):
        fit_curve(pts[:2])


def test_our_learning_curve_contains_our_runs():
    curve = fit_curve(R.LEARNING_CURVE)
    assert 0 < curve.best.a and 0 < curve.best.b < 2
    inside = sum(curve.at(p.tokens).low <= p.tau <= curve.at(p.tokens).high for p in R.LEARNING_CURVE)
    assert inside >= len(R.LEARNING_CURVE) - 1
    assert curve.at(400e6).central > curve.at(60e6).central  # more tokens, more acceptance


def test_training_flops_match_the_trainers_count():
    """The plan's FLOPs per token (default target, online) against the trainer's own MFU accounting of
    a recorded run: mfu x peak / tokens/s, step by step."""
    from outrider.plan.cost_model import ModelShape, eagle3_head_shape
    from outrider.plan.presets import SMOLLM2_135M

    shape = ModelShape.from_arch(SMOLLM2_135M)
    rows = [json.loads(x) for x in gzip.open(RESULTS / "h200-train-metrics-16.jsonl.gz")]
    steps = [r for r in rows if r.get("type") == "train" and r.get("mfu")][100:]
    measured = sum(r["mfu"] * 989e12 / r["tokens_per_s"] for r in steps) / len(steps)
    example = 498  # the run's data: 18.4 M training tokens in 37,018 examples
    planned = target_flops_per_token(shape, 32000, example) + head_flops_per_token(
        eagle3_head_shape(SMOLLM2_135M, 32000), 7, R.RATES["reply_share"].value, example)
    assert planned == pytest.approx(measured, rel=0.12)


def test_default_plan_from_its_formulas():
    p = train_plan("default", "h200", conversations=21_000, tokens_per_turn=400, epochs=8.8)
    regen, capture, cache, train, evaluation = p.stages
    assert (regen.mode, capture.mode, cache.mode, train.mode) == ("local", "online", "none", "online")
    G = 21_000 * 400 * R.RATES["reply_share"].value
    # the default target at the measured run's context: the measured rate itself
    assert regen.time.value == pytest.approx(G / R.RATES["regen_tokens_per_s"].value, rel=1e-6)
    assert train.time.value == pytest.approx(p.sizes.train_tokens * 0.915e9 / (989e12 * 0.166), rel=0.05)
    assert 0.8 * 450 < train.time.value < 1.2 * 450  # the recorded run: 73.6 M tokens in 450 s
    assert train.gpu_hours.value == pytest.approx(train.time.value / 3600)
    assert capture.time.value == 0 and cache.disk.value == 0
    assert evaluation.time.value > R.RATES["eval_warmup_s"].value
    assert 2.3 < p.tau.central < 2.8 and p.tau.low < p.tau.central < p.tau.high


@pytest.fixture(scope="module")
def kimi_plans():
    kw = dict(conversations=20_000, tokens_per_turn=2048, max_length=2048, epochs=3, k=3)
    return train_plan("kimi-k2.5", "rtx-pro-6000", gpus=8, **kw), train_plan("kimi-k2.5", "h200", gpus=1, **kw)


def test_kimi_plans_are_complete(kimi_plans):
    for p in kimi_plans:
        assert [s.name for s in p.stages] == ["regeneration", "capture", "cache", "training", "evaluation"]
        for s in p.stages:
            for fig in (s.time, s.memory, s.disk):
                assert fig.formula and fig.value >= 0
            for src in s.time.sources:  # every rate a figure names is in the table, with its kind
                assert src in p.rates or src.startswith("cost model")
        assert p.total_s > 0 and p.total_gpu_hours > 0 and p.disk_gb > 0
        text = render_markdown(p)
        for name in ("regeneration", "capture", "cache", "training", "evaluation", "estimate, not measured",
                     "Expected held-out tau@5", "published EAGLE-3 heads for Kimi-K2.5"):
            assert name in text
        json.dumps(to_json(p))
    rtx, h200 = kimi_plans
    H = 7168
    assert rtx.stages[1].mode == "engine" and "--engine vllm --server" in " ".join(rtx.stages[1].notes) and rtx.stages[0].gpus == 8
    assert rtx.stages[2].disk.value == pytest.approx(rtx.sizes.distinct_tokens * 4 * H * 2 / 1e9)
    assert all(s.memory.value < 96 for s in rtx.stages)
    # one H200 cannot hold the target: capture streams it layer by layer on that GPU, serving goes to a node
    assert h200.stages[1].mode == "streamed" and h200.stages[1].gpus == 1
    assert 592 / 61 < h200.stages[1].memory.value < 141
    assert h200.stages[0].mode == "served" and h200.stages[0].gpus == 8
    assert h200.stages[3].mode.startswith("from the") and h200.stages[3].memory.value < 141
    assert "do not fit 1 of them" in " ".join(h200.stages[0].notes)


def test_cache_dtype_and_modes():
    assert cache_bytes_per_token(7168, "bf16")[0] == 57344
    assert cache_bytes_per_token(7168, "fp8")[0] == pytest.approx(4 * 7168 + 16)
    fp8 = train_plan("kimi-k2.5", "h200", cache_dtype="fp8", epochs=1)
    bf16 = train_plan("kimi-k2.5", "h200", cache_dtype="bf16", epochs=1)
    assert fp8.stages[2].disk.value == pytest.approx(bf16.stages[2].disk.value * (4 * 7168 + 16) / 57344)
    none = train_plan("default", "h200", regenerate="none", capture="streamed")
    assert none.stages[0].time.value == 0 and none.stages[2].disk.value > 0
    with pytest.raises(UserError, match="--capture online"):
        train_plan("kimi-k2.5", "h200", capture="online")
    with pytest.raises(UserError, match="--regenerate served"):
        train_plan("kimi-k2.5", "rtx-pro-6000", gpus=8, regenerate="local")
    with pytest.raises(UserError, match="--epochs"):
        train_plan("default", "h200", epochs=0)
    with pytest.raises(UserError, match="cache dtype"):
        train_plan("default", "h200", cache_dtype="int4", capture="streamed")


def test_streamed_capture_on_n_gpus_is_bounded_by_host_memory_and_storage():
    kw = dict(conversations=20_000, tokens_per_turn=2048, max_length=2048, epochs=1, capture="streamed")
    one, eight = (train_plan("kimi-k2.5", "h200", gpus=n, **kw).stages[1] for n in (1, 8))
    W = 0.995 * 592e9  # Kimi-K2.5's INT4 checkpoint (592 GB, rounded), read once per pass by each rank
    assert one.gpus == 1 and eight.gpus == 8 and eight.time.value < one.time.value / 4
    for stage in (one, eight):  # 2 TB of host memory: the page cache keeps the checkpoint, storage reads it once
        assert "first pass from storage" in stage.time.formula and "stays in the page cache" in " ".join(stage.notes)
        passes = int(stage.notes[0].split(" pass(es)")[0])
        assert stage.time.value >= W / 5e9 + (passes - 1) * W / 5e9
    small = {"host_memory_bytes": 7e11}  # the checkpoint and one rank's buffers fit, not eight ranks'
    one, eight = (train_plan("kimi-k2.5", "h200", gpus=n, rates=small, **kw).stages[1] for n in (1, 8))
    assert "stays in the page cache" in " ".join(one.notes)
    assert "does not stay" in " ".join(eight.notes) and "beyond 1 rank(s)" in " ".join(eight.notes)
    passes = int(eight.notes[0].split(" pass(es)")[0])
    assert eight.time.value >= passes * W / (5e9 / 8)  # eight ranks share one storage's 5 GB/s every pass


def test_rates_from_a_file(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"regen_tokens_per_s": {"value": 30500, "source": "my run"}}))
    base = train_plan("default", "h200")
    faster = train_plan("default", "h200", rates=str(path))
    assert faster.stages[0].time.value == pytest.approx(base.stages[0].time.value / 2)
    assert faster.rates["regen_tokens_per_s"].source == "my run"
    path.write_text(json.dumps({"warp_speed": 9}))
    with pytest.raises(UserError, match="unknown rate"):
        train_plan("default", "h200", rates=str(path))


def test_cli_train_plan(tmp_path, capsys):
    md, js = tmp_path / "PLAN.md", tmp_path / "plan.json"
    rc = main(["plan", "kimi-k2.5", "--hardware", "h200", "--train", "--conversations", "5000", "--epochs", "2",
               "--out", str(md), "--json", str(js)])
    assert rc == 0
    assert md.read_text().startswith("# Training plan: an EAGLE-3 head for Kimi-K2.5 on 1 x h200")
    data = json.loads(js.read_text())
    assert [s["stage"] for s in data["stages"]][1] == "capture" and data["stages"][1]["mode"] == "streamed"
    assert data["tau"]["low"] <= data["tau"]["central"] <= data["tau"]["high"]
    assert "Training plan" in capsys.readouterr().out
    rc = main(["plan", "kimi-k2.5", "--hardware", "h200", "--train", "--capture", "online"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--capture online" in err and err.count("\n") == 1


def test_streamed_capture_memory_is_the_streamers_plan():
    """``plan --train --capture streamed`` sizes the pass with ``outrider.memory_plan`` as the streamer
    does: its peak is StreamMemory's for the chunk it picks, under the GPU's share, and one example
    too wide for any chunk is refused in one line."""
    from outrider.memory_plan import RESERVE, analytic_working_set
    from outrider.models import ArchInfo
    from outrider.plan.presets import PRESETS

    kw = dict(conversations=20_000, tokens_per_turn=2048, max_length=2048, epochs=1, capture="streamed")
    stage = train_plan("kimi-k2.5", "h100", serve_gpus=16, **kw).stages[1]
    assert "outrider.memory_plan" in stage.memory.formula and "mlp 731.5 kB/token" in stage.memory.formula
    assert 0.9 * 80 * 0.9 < stage.memory.value <= 0.9 * 80 * (1 - RESERVE) + 1e-9  # filled to the plan's share
    arch: ArchInfo = PRESETS["kimi-k2.5"][1]
    chunk = int(stage.memory.formula.split("a chunk of ")[1].split(" tokens")[0].replace(",", ""))
    assert chunk % 2048 == 0 and 2048 <= chunk < 32768 and "in pinned host memory" in stage.memory.formula
    working = analytic_working_set(arch, 2)
    more = working.bytes(chunk + 2048, 2048) - working.bytes(chunk, 2048) + 2048 * arch.hidden_size * 2
    assert stage.memory.value * 1e9 + more > 0.9 * 80e9 * (1 - RESERVE)  # one row more would not have fitted
    with pytest.raises(UserError, match="too small for layer streaming: a chunk of 131,072 token"):
        train_plan("kimi-k2.5", "h100", serve_gpus=16, **dict(kw, tokens_per_turn=131072, max_length=131072))
