"""``plan``: presets, config-only folders, acceptance files, calibration, JSON rows, errors."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from outrider.errors import UserError
from outrider.plan.planner import plan
from tests.tiny import tiny_config


def quiet():
    buf = io.StringIO()
    return Console(file=buf, width=160), buf


@pytest.fixture(scope="module")
def kimi_plan(tmp_path_factory):
    """Kimi-K2.5 INT4 on 8 x RTX PRO 6000, TP 8: EAGLE-3 at tau 3 (k=3), n-gram at low acceptance."""
    out = tmp_path_factory.mktemp("plan") / "rows.json"
    console, buf = quiet()
    result = plan("kimi-k2.5", "rtx-pro-6000", tp=8, batches=[1, 8, 64], tau=3.0, ks=range(1, 8),
                  json_path=str(out), console=console)
    return result, json.loads(out.read_text()), buf.getvalue()


def test_kimi_rtx_pro_6000_tp8(kimi_plan):
    result, rows, text = kimi_plan
    assert {(r["method"], r["batch"]) for r in rows} == {(m, b) for m in ("eagle3", "ngram") for b in (1, 8, 64)}
    assert len(rows) == 2 * 3 * 7
    for r in rows:
        assert {"method", "k", "batch", "tokens_per_s", "speedup", "verify_cost_ratio"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0
    by = {(r["method"], r["k"], r["batch"]): r for r in rows}
    assert by[("eagle3", 3, 1)]["expected_tokens"] == pytest.approx(3.0, abs=1e-6)
    assert by[("eagle3", 3, 1)]["speedup"] > 1.0
    for b in (1, 8, 64):
        ratios = [by[("eagle3", k, b)]["verify_cost_ratio"] for k in range(1, 8)]
        assert ratios[0] > 1.0 and all(x < y for x, y in zip(ratios, ratios[1:]))  # every draft wakes experts
        # low-acceptance n-gram never beats EAGLE-3 at the same k
        assert all(by[("ngram", k, b)]["speedup"] < by[("eagle3", k, b)]["speedup"] for k in range(1, 8))
        assert by[("ngram", 7, b)]["speedup"] < 1.0
    # batch 1 on PCIe: the AllReduce latency is the plain step's largest term
    ar1 = result.predictions[0].verify  # any batch-1 verify step has the term
    assert ar1.term_s("AllReduce") > 0
    assert "AllReduce" in text and "routed-expert weights" in text
    assert len(result.recommendations) == 3
    rec1 = result.recommendations[0]
    assert rec1.method == "eagle3" and rec1.speedup > 1.0 and "dominant terms" in rec1.text
    assert "tau=3 at k=3" in text and "assumed alpha=0.2" in text


def test_acceptance_file_and_do_not_speculate(tmp_path):
    bench = [
        {"method": "ar", "k": 0, "tau": 1.0, "accept_rate_per_pos": []},
        {"method": "ngram", "k": 3, "tau": 1.0, "accept_rate_per_pos": [0.0, 0.0, 0.0]},
        {"method": "medusa", "k": 3, "tau": 2.0, "accept_rate_per_pos": [0.5, 0.5, 0.5]},
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    console, buf = quiet()
    result = plan("kimi-k2.5", "rtx-pro-6000", tp=8, batches=[1, 8], acceptance=str(path), ks=[1, 2, 3],
                  console=console)
    assert {p.method for p in result.predictions} == {"ngram"}
    assert all(r.method is None and "do not speculate" in r.text for r in result.recommendations)
    assert "'medusa' is not modelled" in buf.getvalue()


def test_acceptance_per_k_from_bench(tmp_path):
    bench = [{"method": "eagle3", "k": 2, "tau": 2.4, "accept_rate_per_pos": [0.8, 0.75]},
             {"method": "eagle3", "k": 4, "tau": 3.0, "accept_rate_per_pos": [0.8, 0.7, 0.6, 0.5]}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    result = plan("default", "h200", acceptance=str(path), ks=[1, 2, 4, 6], console=quiet()[0])
    e = {p.k: p.expected_tokens for p in result.predictions}
    assert e[2] == pytest.approx(2.4)
    assert e[4] == pytest.approx(1 + 0.8 + 0.56 + 0.336 + 0.168)
    assert e[6] > e[4]  # beyond the measured positions the last rate repeats


def test_config_only_folders(tmp_path):
    moe_dir = tmp_path / "moe"
    tiny_config("deepseek_v3").save_pretrained(moe_dir)
    result = plan(str(moe_dir), "h100", tp=2, batches=[1, 4], alpha=0.6, ks=[1, 2], console=quiet()[0])
    assert len(result.predictions) == 2 * 2 * 2
    dense_dir = tmp_path / "dense"
    tiny_config("llama").save_pretrained(dense_dir)
    draft_dir = tmp_path / "draft"
    tiny_config("llama", layers=1).save_pretrained(draft_dir)
    result = plan(str(dense_dir), "b200", alpha=0.7, ks=[2], draft=str(draft_dir), console=quiet()[0])
    assert {p.method for p in result.predictions} == {"eagle3", "draft", "ngram"}


def test_calibration_files(tmp_path):
    bench = [{"method": "eagle3", "k": 3, "ar_step_ms": 1.53, "verify_step_ms": {"1": 1.55, "3": 1.6, "7": 1.7},
              "draft_step_ms": 0.9, "tau": 3.0, "accept_rate_per_pos": [0.8, 0.7, 0.6]}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    console, buf = quiet()
    result = plan("default", "h200", acceptance=str(path), calibrate=str(path), ks=[1, 3, 7], console=console)
    by_k = {p.k: p for p in result.predictions}
    assert by_k[1].ar_step_s == pytest.approx(1.53e-3, rel=0.05)
    assert by_k[3].verify_step_s == pytest.approx(1.6e-3, rel=0.05)
    assert by_k[3].draft_round_s == pytest.approx(0.9e-3)  # measured draft round used as is
    assert "calibrated (bench.json)" in buf.getvalue()

    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"single_stream_tokens_per_s": 60, "allreduce_share": 0.45,
                                    "collectives_per_token": 122}))
    result = plan("kimi-k2.5", "rtx-pro-6000", tp=8, tau=3.0, ks=[3], calibrate=str(measured), console=quiet()[0])
    assert result.predictions[0].ar_tokens_per_s == pytest.approx(60, rel=1e-6)

    no_times = tmp_path / "plain.json"
    no_times.write_text(json.dumps([{"method": "eagle3", "k": 3, "tau": 3.0, "speedup_vs_ar": 2.1}]))
    with pytest.raises(UserError, match="ar_step_ms"):
        plan("default", "h200", calibrate=str(no_times), console=quiet()[0])


@pytest.mark.parametrize("kwargs,needle", [
    (dict(hardware="a100-ish"), "unknown hardware"),
    (dict(tau=0.8), "tau"),
    (dict(tau=4.5), "impossible"),
    (dict(alpha=1.0), "alpha"),
    (dict(alpha=-0.1), "alpha"),
    (dict(alpha=0.5, tau=2.0), "only one"),
    (dict(batches=[0]), "batch"),
    (dict(ks=[]), "k values"),
    (dict(tp=0), "--tp"),
    (dict(weight_dtype="int2"), "weight dtype"),
    (dict(acceptance="/nonexistent/bench.json"), "not found"),
])
def test_user_errors(kwargs, needle):
    args = dict(target="default", hardware="h200")
    args.update(kwargs)
    with pytest.raises(UserError) as e:
        plan(console=quiet()[0], **args)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_acceptance_files(tmp_path):
    cases = {"notjson.json": "{oops", "obj.json": '{"a": 1}', "nok.json": '[{"method": "eagle3", "tau": 2.0}]',
             "onlyar.json": '[{"method": "ar", "k": 0}]',
             "badrates.json": '[{"method": "eagle3", "k": 2, "accept_rate_per_pos": [2, 0.5]}]'}
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(UserError):
            plan("default", "h200", acceptance=str(path), console=quiet()[0])
    with pytest.raises(UserError, match="no config.json|not found"):
        plan(str(tmp_path), "h200", console=quiet()[0])


def test_routing_histogram(tmp_path):
    skewed = [40.0] * 48 + [1.0] * 336
    path = tmp_path / "hist.json"
    path.write_text(json.dumps(skewed))
    base = plan("kimi-k2.5", "rtx-pro-6000", tp=8, batches=[8], tau=3.0, ks=[3], console=quiet()[0])
    hot = plan("kimi-k2.5", "rtx-pro-6000", tp=8, batches=[8], tau=3.0, ks=[3], routing_histogram=str(path),
               console=quiet()[0])
    # concentrated routing: fewer distinct experts per verify step -> cheaper verification
    assert hot.predictions[0].verify_step_s < base.predictions[0].verify_step_s
    with pytest.raises(UserError, match="384 routed experts"):
        plan("kimi-k2.5", "rtx-pro-6000", tp=8, routing_histogram=[1.0, 2.0], console=quiet()[0])
