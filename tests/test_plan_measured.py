"""``--measured``: a profile fitted to a user's measurements recovers known parameters; metrics of the
engines parse; the issue's Kimi-K2.5 profile is reproduced and predicts n-gram as a loss."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
from rich.console import Console

from outrider.errors import UserError
from outrider.plan.cost_model import ModelShape, forward_overhead_s, step_cost
from outrider.plan.hardware import load_profile, parse_precision
from outrider.plan.measured import (
    acceptance_from_sglang,
    acceptance_from_vllm,
    fit_profile,
    measured_from,
    read_measured,
)
from outrider.plan.planner import plan
from outrider.plan.presets import KIMI_K25, SMOLLM2_135M
from outrider.plan.published import (
    ISSUE_NGRAM_SLOWER,
    VLLM_NGRAM_K,
    compare,
    issue_profile_check,
)


@pytest.fixture(scope="module")
def kimi():
    return ModelShape.from_arch(KIMI_K25, parse_precision("int4-g32/bf16"))


def _measure(shape, truth, tp, batches, share_at=(), context=2048):
    """What a profiler would report on hardware that behaves exactly as ``truth``."""
    decode, share = {}, {}
    for b in batches:
        cost = step_cost(shape, truth, tp, 1, b, context)
        decode[str(b)] = b / cost.total_s
        if b in share_at:
            share[str(b)] = cost.term_s("AllReduce") / cost.total_s
    return {"tp": tp, "decode_tokens_per_s": decode, "collective_share": share,
            "collectives_per_token": truth.collectives_per_layer * shape.num_layers}


def test_fit_recovers_known_parameters(kimi):
    hw = load_profile("rtx-pro-6000")
    truth = replace(hw, memory_efficiency=0.55, step_overhead_s=400e-6, layer_overhead_s=30e-6, link_latency_s=6e-6,
                    link_efficiency=0.5, collectives_per_layer=2.5)
    fit = fit_profile(kimi, hw, 8, read_measured(_measure(kimi, truth, 8, (1, 4, 16, 64, 256), share_at=(1, 64))))
    got = fit.profile
    assert got.memory_efficiency == pytest.approx(0.55, rel=0.01)
    assert forward_overhead_s(kimi, got) == pytest.approx(forward_overhead_s(kimi, truth), rel=0.02)
    assert got.link_latency_s == pytest.approx(6e-6, rel=0.01)
    assert got.link_bandwidth_bytes_per_s * got.link_efficiency == pytest.approx(32e9, rel=0.01)
    assert got.collectives_per_layer == pytest.approx(2.5)
    assert fit.max_relative_error < 0.005
    changes = {c.name: c for c in fit.changes}
    assert changes["memory efficiency"].moved and changes["link latency per ring hop"].moved
    assert not changes["compute efficiency"].constrained  # every step memory-bound: nothing to fit it to
    assert got.compute_efficiency == hw.compute_efficiency
    assert "moved: memory efficiency: 0.8 -> 0.55" in fit.summary()


def test_fit_recovers_compute_efficiency_of_a_dense_model():
    """A dense model at large batches turns compute-bound: then compute efficiency is fitted too."""
    shape = ModelShape.from_arch(SMOLLM2_135M)
    hw = load_profile("h200")
    truth = replace(hw, memory_efficiency=0.4, compute_efficiency=0.3, step_overhead_s=200e-6, layer_overhead_s=10e-6)
    fit = fit_profile(shape, hw, 1, read_measured(_measure(shape, truth, 1, (1, 64, 1024, 4096, 16384))))
    assert fit.profile.memory_efficiency == pytest.approx(0.4, rel=0.02)
    assert fit.profile.compute_efficiency == pytest.approx(0.3, rel=0.02)
    assert fit.max_relative_error < 0.005


def test_one_rate_fixes_the_overhead_only(kimi):
    hw = load_profile("rtx-pro-6000")
    fit = fit_profile(kimi, hw, 8, read_measured({"decode_tokens_per_s": 60.0, "collective_share": 0.45,
                                                  "collectives_per_token": 122}))
    cost = step_cost(kimi, fit.profile, 8, 1, 1, 2048)
    assert cost.total_s == pytest.approx(1 / 60, rel=1e-6)
    assert cost.term_s("AllReduce") == pytest.approx(0.45 / 60, rel=1e-6)
    assert not {c.name: c for c in fit.changes}["memory efficiency"].constrained


def test_issue_profile_reproduced_and_ngram_a_loss():
    chk = issue_profile_check()
    assert chk["plain_tokens_per_s"] == pytest.approx(82.5, rel=1e-6)
    fit = chk["fit"]
    cost = step_cost(ModelShape.from_arch(KIMI_K25, parse_precision("int4-g32/bf16")), fit.profile, 8, 1, 1, 2048)
    assert cost.term_s("AllReduce") / cost.total_s == pytest.approx(0.515, rel=1e-6)
    assert fit.profile.collectives_per_layer * 61 == pytest.approx(127)
    ngram = chk["ngram"]
    lo, hi = 1 - ISSUE_NGRAM_SLOWER[1], 1 - ISSUE_NGRAM_SLOWER[0]
    assert lo <= ngram[VLLM_NGRAM_K].speedup <= hi  # vLLM's documented n-gram k: inside the measured 9-26 %
    assert all(ngram[k].speedup < 1.0 for k in range(3, 8))
    assert all(chk["break_even_tau"][k] > ngram[k].expected_tokens for k in range(3, 8))


def test_published_cases_are_all_predicted():
    rows = compare()
    assert {r["case"] for r in rows} >= {"DeepSeek-V3 MTP, SGLang, 8 x H200", "gpt-oss-120b EAGLE-3, SGLang, 1 x H100"}
    for r in rows:
        assert r["predicted"] > 0 and r["published"] > 0 and r["source"]
    cal = [r for r in rows if r["published_baseline"]]
    for r in cal:  # calibrated on the published plain speeds, the plain speeds come back within 25 %
        assert r["calibrated_baseline"] == pytest.approx(r["published_baseline"], rel=0.25)


VLLM_TEXT = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="kimi"} 600.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="kimi"} 400.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="kimi"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="kimi"} 3000.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="kimi"} 1190.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="kimi",position="0"} 400.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="kimi",position="0"} 300.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="kimi",position="1"} 350.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="kimi",position="2"} 140.0
"""


def test_vllm_and_sglang_metrics(tmp_path):
    # counters of 1,000 drafts whose conditional rates are 0.7, 0.5, 0.4: 700, 350, 140 accepted at positions 0-2
    method, k, acc = acceptance_from_vllm({"method": "eagle3", "text": VLLM_TEXT})
    assert (method, k) == ("eagle3", 3)
    assert acc.rates == pytest.approx((0.7, 0.5, 0.4))
    assert acc.expected_tokens(3) == pytest.approx(2.19)
    (tmp_path / "metrics.txt").write_text(VLLM_TEXT)
    _, _, acc2 = acceptance_from_vllm({"method": "ngram", "k": 3, "file": "metrics.txt"}, base=tmp_path)
    assert acc2.rates == acc.rates
    _, _, acc3 = acceptance_from_vllm({"method": "eagle3", "num_drafts": 1000, "accepted_per_pos": [700, 350, 140]})
    assert acc3.rates == pytest.approx(acc.rates)
    info = {"method": "eagle3", "k": 3, "internal_states": [{"avg_spec_accept_length": 2.9}]}
    assert acceptance_from_sglang(info)[2].expected_tokens(3) == pytest.approx(2.9)
    text = 'sglang:spec_accept_length{model_name="k"} 2.5\n'
    assert acceptance_from_sglang({"method": "eagle3", "k": 3, "text": text})[2].expected_tokens(3) == pytest.approx(2.5)
    with pytest.raises(UserError, match="'k'"):
        acceptance_from_sglang({"method": "eagle3", "spec_accept_length": 2.5})
    with pytest.raises(UserError, match="num_drafts"):
        acceptance_from_vllm({"method": "eagle3", "text": "nothing here 1\n"})


@pytest.mark.parametrize("data,needle", [
    ([1, 2], "JSON object"),
    ({"decode_tps": 80}, "unknown key"),
    ({"decode_tokens_per_s": -3}, "decode_tokens_per_s"),
    ({"decode_tokens_per_s": {"x": 3}}, "batch sizes"),
    ({"decode_tokens_per_s": 80, "collective_share": {"8": 0.3}}, "without the decode"),
    ({"decode_tokens_per_s": 80, "collective_share": 1.5}, "collective_share"),
    ({"tp": 0}, "'tp'"),
    ({"vllm_metrics": {"k": 3}}, "'method'"),
])
def test_bad_measurements(data, needle):
    with pytest.raises(UserError) as e:
        read_measured(data, "m.json")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_planner_with_measured_file_and_flags(tmp_path, kimi):
    hw = load_profile("rtx-pro-6000")
    truth = replace(hw, memory_efficiency=0.6, step_overhead_s=2e-3)
    data = _measure(kimi, truth, 8, (1, 8, 64), share_at=(1,))
    data["vllm_metrics"] = {"method": "eagle3", "num_drafts": 1000, "accepted_per_pos": [700, 350, 140]}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(data))
    out = io.StringIO()
    result = plan("kimi-k2.5", "rtx-pro-6000", tp=8, batches=[1, 8, 64], ks=[3], measured=str(path),
                  console=Console(file=out, width=200))
    ar = {p.batch: p.ar_tokens_per_s for p in result.predictions if p.method == "eagle3"}
    for b in (1, 8, 64):
        assert ar[b] == pytest.approx(data["decode_tokens_per_s"][str(b)], rel=0.01)
    e3 = next(p for p in result.predictions if p.method == "eagle3")
    assert e3.expected_tokens == pytest.approx(2.19)  # vLLM's counters, not the assumed tau 3
    text = out.getvalue()
    assert "Fitted to the measurements" in text and "memory efficiency: 0.8 -> 0.6" in text
    # flags over the file: the batch-1 rate given on the command line replaces the file's
    merged = measured_from(str(path), {1: 50.0}, None, None)
    assert merged.decode[1] == 50.0 and merged.decode[8] == pytest.approx(data["decode_tokens_per_s"]["8"])
    assert measured_from(None, None, None, None) is None
    with pytest.raises(UserError, match="pass --tp 8"):
        plan("kimi-k2.5", "rtx-pro-6000", tp=4, measured=str(path), console=Console(file=io.StringIO()))
