"""Cost model: formulas, units, monotonicity, profiles, calibration."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from outrider.errors import UserError
from outrider.models import arch_info
from outrider.plan.acceptance import (
    Acceptance,
    alpha_from_tau,
    expected_tokens_alpha,
    expected_tokens_chain,
)
from outrider.plan.calibrate import calibrate, calibrate_measured
from outrider.plan.cost_model import (
    WEIGHT_FORMATS,
    DraftSpec,
    ModelShape,
    allreduce_s,
    draft_round_cost,
    eagle3_head_shape,
    expected_distinct_experts,
    predict,
    step_cost,
)
from outrider.plan.hardware import (
    builtin_profiles,
    load_profile,
    parse_precision,
    profile_from_dict,
)
from outrider.plan.presets import KIMI_K25, SMOLLM2_135M
from tests.tiny import tiny_config


@pytest.fixture(scope="module")
def kimi():
    return ModelShape.from_arch(KIMI_K25, parse_precision("int4-g32/bf16"))


@pytest.fixture(scope="module")
def smol():
    return ModelShape.from_arch(SMOLLM2_135M)


# ---- formulas -------------------------------------------------------------------------------

def test_distinct_experts_matches_design_numbers():
    got = [round(expected_distinct_experts(384, 8, n)) for n in (1, 4, 8, 16)]
    assert got == [8, 31, 60, 110]
    assert expected_distinct_experts(384, 8, 10_000) == pytest.approx(384, rel=1e-6)
    assert expected_distinct_experts(0, 0, 16) == 0.0


def test_distinct_experts_histogram():
    uniform = [5.0] * 384
    assert expected_distinct_experts(384, 8, 16, uniform) == pytest.approx(expected_distinct_experts(384, 8, 16))
    # concentrated routing wakes fewer distinct experts than uniform routing for the same tokens
    skewed = [50.0] * 32 + [1.0] * 352
    assert expected_distinct_experts(384, 8, 16, skewed) < expected_distinct_experts(384, 8, 16)
    with pytest.raises(UserError):
        expected_distinct_experts(4, 2, 3, [0, 0, 0, 0])


def test_expected_tokens_chain_and_alpha():
    assert expected_tokens_chain([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens_chain([]) == 1.0
    for alpha in (0.0, 0.3, 0.8):
        for k in (1, 3, 7):
            assert expected_tokens_alpha(alpha, k) == pytest.approx(expected_tokens_chain([alpha] * k))
    assert expected_tokens_alpha(1.0, 3) == 4.0
    a = alpha_from_tau(3.0, 3)
    assert expected_tokens_alpha(a, 3) == pytest.approx(3.0, abs=1e-9)
    for bad in (0.5, 4.0, 5.0):
        with pytest.raises(UserError):
            alpha_from_tau(bad, 3)
    with pytest.raises(UserError):
        Acceptance.from_alpha(1.0)
    with pytest.raises(UserError):
        Acceptance.from_tau(0.9, 3)


def test_acceptance_rates_extend_with_last_rate():
    acc = Acceptance.from_rates([0.9, 0.7])
    assert acc.rates_for(4) == (0.9, 0.7, 0.7, 0.7)
    assert acc.expected_tokens(1) == pytest.approx(1.9)


def test_acceptance_from_record_tells_conditional_from_unconditional():
    cond = Acceptance.from_record({"method": "eagle3", "k": 3, "accept_rate_per_pos": [0.8, 0.75, 0.7],
                                   "tau": 1 + 0.8 + 0.6 + 0.42})
    assert cond.rates == pytest.approx((0.8, 0.75, 0.7))
    # unconditional: P(at least i accepted) = 0.8, 0.6, 0.42 with tau = 1 + their sum
    uncond = Acceptance.from_record({"method": "eagle3", "k": 3, "accept_rate_per_pos": [0.8, 0.6, 0.42],
                                     "tau": 2.82})
    assert uncond.rates == pytest.approx((0.8, 0.75, 0.7))
    assert uncond.expected_tokens(3) == pytest.approx(2.82)
    # rates per proposed draft from a proposer that proposes in 55 % of the steps: gated to tau
    gated = Acceptance.from_record({"method": "ngram", "k": 2, "accept_rate_per_pos": [0.36, 0.5],
                                    "tau": 1 + 0.55 * (0.36 + 0.36 * 0.5)})
    assert gated.expected_tokens(2) == pytest.approx(1 + 0.55 * 0.54)
    assert gated.rates[1] == pytest.approx(0.5)
    only_tau = Acceptance.from_record({"method": "ngram", "k": 4, "tau": 1.5})
    assert only_tau.expected_tokens(4) == pytest.approx(1.5)
    for bad in ({"method": "x", "k": 3}, {"method": "x", "accept_rate_per_pos": [1.5]},
                {"method": "x", "accept_rate_per_pos": "0.5"}):
        with pytest.raises(UserError):
            Acceptance.from_record(bad)


def test_allreduce_ring_formula():
    hw = load_profile("rtx-pro-6000")
    assert allreduce_s(1e6, 1, hw) == 0.0
    want = 14 * hw.link_latency_s + 14 / 8 * 1e6 / (hw.link_bandwidth_bytes_per_s * hw.link_efficiency)
    assert allreduce_s(1e6, 8, hw) == pytest.approx(want)
    two = 2 * hw.link_latency_s + 1e6 / (hw.link_bandwidth_bytes_per_s * hw.link_efficiency)
    assert allreduce_s(1e6, 2, hw) == pytest.approx(two)


# ---- units and counts -----------------------------------------------------------------------

def test_parameter_counts(smol, kimi):
    assert smol.total_params == pytest.approx(134.5e6, rel=1e-3)  # SmolLM2-135M without norms
    assert smol.weight_bytes == pytest.approx(2 * smol.total_params)
    assert kimi.total_params == pytest.approx(1.03e12, rel=0.03)  # "1T total"
    active = (kimi.num_layers * kimi.attn_params + kimi.dense_layers * kimi.dense_mlp_params
              + kimi.moe_layers * (8 * kimi.expert_params + kimi.shared_params) + kimi.lm_head_params)
    assert 30e9 < active < 34e9  # "32B active"
    assert WEIGHT_FORMATS["int4-g32"].bytes_per_param == pytest.approx(0.5625)
    assert WEIGHT_FORMATS["fp8"].bytes_per_param == pytest.approx(1.0 + 4 / 16384)


def test_step_terms_are_seconds_from_bytes(smol):
    hw = load_profile("h200")
    cost = step_cost(smol, hw, tp=1, new_tokens=1, batch=1, context=0)
    bw = hw.measured_memory_bandwidth_bytes_per_s * hw.memory_efficiency
    mlp = cost.terms[[t.name for t in cost.terms].index("dense MLP weights")]
    assert mlp.bytes == 30 * 3 * 576 * 1536 * 2
    assert mlp.time_s == pytest.approx(mlp.bytes / bw)
    assert mlp.flops == 2 * 30 * 3 * 576 * 1536
    assert cost.term_s("fixed overhead") == pytest.approx(hw.step_overhead_s + 31 * hw.layer_overhead_s)
    assert cost.total_s == pytest.approx(sum(t.time_s for t in cost.terms))
    assert "AllReduce" not in [t.name for t in cost.terms]
    # a huge batch of tokens turns the matmuls compute-bound
    big = step_cost(smol, hw, 1, 1, 65536, 0)
    assert big.terms[0].bound == "compute"
    assert big.terms[0].time_s == pytest.approx(big.terms[0].flops / (hw.measured_bf16_flops_per_s * hw.compute_efficiency))


def test_mla_cache_is_replicated_and_gqa_cache_sharded(kimi, smol):
    hw = load_profile("h200")
    c1 = step_cost(kimi, hw, 1, 1, 1, 4096).term_s("MLA latent cache")
    c8 = step_cost(kimi, hw, 8, 1, 1, 4096).term_s("MLA latent cache")
    assert c8 == pytest.approx(c1)
    assert step_cost(kimi, hw, 1, 1, 1, 4096).terms[-2].bytes == 4097 * 576 * 2 * 61
    g1 = step_cost(smol, hw, 1, 1, 1, 4096).term_s("KV cache")
    g3 = step_cost(smol, hw, 3, 1, 1, 4096).term_s("KV cache")
    g8 = step_cost(smol, hw, 8, 1, 1, 4096).term_s("KV cache")
    assert g3 == pytest.approx(g1 / 3) and g8 == pytest.approx(g3)  # 3 KV heads: replicated beyond tp=3


def test_config_shapes_from_tiny_models():
    moe = ModelShape.from_arch(arch_info(tiny_config("deepseek_v3")))
    assert moe.attention == "MLA" and moe.moe_layers == 3 and moe.dense_layers == 1
    assert moe.expert_params == 3 * 64 * 32 and moe.shared_params == 3 * 64 * 32
    dense = ModelShape.from_arch(arch_info(tiny_config("llama")))
    assert dense.moe_layers == 0 and dense.kv_elems_per_token == 2 * 2 * 16


# ---- monotonicity ---------------------------------------------------------------------------

def test_more_acceptance_never_predicts_less_speed(kimi):
    hw = load_profile("rtx-pro-6000")
    head = eagle3_head_shape(KIMI_K25)
    for k in (1, 3, 7):
        for b in (1, 64):
            speeds = [predict(kimi, hw, head, Acceptance.from_alpha(a), k, b, 8).tokens_per_s
                      for a in (0.0, 0.2, 0.5, 0.8, 0.95)]
            assert speeds == sorted(speeds)
    lo = predict(kimi, hw, head, Acceptance.from_rates([0.7, 0.5, 0.3]), 3, 1, 8).tokens_per_s
    hi = predict(kimi, hw, head, Acceptance.from_rates([0.7, 0.6, 0.3]), 3, 1, 8).tokens_per_s
    assert hi > lo


def test_more_experts_per_token_never_cheaper_verification(kimi):
    hw = load_profile("rtx-pro-6000")
    for n in (2, 4, 8):
        times = [step_cost(replace(kimi, experts_per_token=e), hw, 8, n, 1, 2048).total_s for e in (2, 4, 8, 16)]
        assert times == sorted(times)
    verify = [step_cost(kimi, hw, 8, n, 1, 2048).total_s for n in range(1, 9)]
    assert verify == sorted(verify)


def test_more_tp_on_pcie_raises_collective_time(kimi):
    hw = load_profile("rtx-pro-6000")
    coll = [step_cost(kimi, hw, tp, 4, 8, 2048).term_s("AllReduce") for tp in (1, 2, 4, 8)]
    assert coll[0] == 0.0 and coll == sorted(coll) and coll[3] > coll[2]
    nvlink = load_profile("h200")
    assert step_cost(kimi, nvlink, 8, 4, 8, 2048).term_s("AllReduce") < coll[3]


def test_draft_costs(smol):
    hw = load_profile("h200")
    assert draft_round_cost(DraftSpec("ngram"), hw, 1, 5, 1, 512).total_s == 0.0
    head = eagle3_head_shape(SMOLLM2_135M)
    r1 = draft_round_cost(head, hw, 1, 1, 1, 512).total_s
    r3 = draft_round_cost(head, hw, 1, 3, 1, 512).total_s
    assert 0 < r1 < r3 < 3 * r1 + 1e-12
    measured = DraftSpec("eagle3", head.shape, head.fc_params, {3: 0.002})
    assert draft_round_cost(measured, hw, 1, 3, 1, 512).total_s == 0.002
    model = DraftSpec("draft", smol)
    assert draft_round_cost(model, hw, 1, 4, 1, 512).total_s == pytest.approx(
        4 * step_cost(smol, hw, 1, 1, 1, 512, include_step_overhead=False).total_s)


# ---- profiles -------------------------------------------------------------------------------

def test_builtin_profiles():
    assert {"h200", "h100", "b200", "rtx-pro-6000"} <= set(builtin_profiles())
    h200 = load_profile("h200")
    assert h200.memory_bandwidth_bytes_per_s == 4.8e12 and h200.measured_memory_bandwidth_bytes_per_s == 4.3e12
    assert h200.bf16_flops_per_s == 989e12 and h200.measured_bf16_flops_per_s == 790e12
    rtx = load_profile("RTX-PRO-6000")
    assert rtx.interconnect == "pcie" and rtx.memory_capacity_bytes == 96e9
    for name in builtin_profiles():
        assert load_profile(name).source


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"name": "x"}', "missing required"),
    ("BASE_PLUS_TYPO", "unknown key"),
    ("BASE_NEG_BW", "must be > 0"),
    ("BASE_BAD_LINK", "interconnect"),
    ("BASE_EFF", "(0, 1]"),
    ("BASE_STR", "must be a number"),
])
def test_bad_profiles_rejected(tmp_path, content, needle):
    base = load_profile("h100").to_dict()
    variants = {
        "BASE_PLUS_TYPO": {**base, "memory_bandwith": 1},
        "BASE_NEG_BW": {**base, "memory_bandwidth_bytes_per_s": -1},
        "BASE_BAD_LINK": {**base, "interconnect": "infiniband"},
        "BASE_EFF": {**base, "memory_efficiency": 1.5},
        "BASE_STR": {**base, "bf16_flops_per_s": "989e12"},
    }
    text = json.dumps(variants[content]) if content in variants else content
    path = tmp_path / "gpu.json"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        load_profile(str(path))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_user_profile_and_unknown_names(tmp_path):
    data = {**load_profile("h100").to_dict(), "name": "my-gpu", "layer_overhead_s": 0.0}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    assert load_profile(path).name == "my-gpu"
    with pytest.raises(UserError, match="unknown hardware"):
        load_profile("tpu-v9")
    with pytest.raises(UserError, match="not found"):
        load_profile(str(tmp_path / "missing.json"))
    with pytest.raises(UserError):
        profile_from_dict("h100")


def test_precision_parsing():
    p = parse_precision("int4-g32/bf16")
    assert p.experts.bytes_per_param == 0.5625 and p.other.bytes_per_param == 2.0
    assert parse_precision("FP8").experts == parse_precision("fp8").other
    for bad in ("int3", "a/b/c", "bf16/int2"):
        with pytest.raises(UserError):
            parse_precision(bad)


# ---- calibration ----------------------------------------------------------------------------

def _records(shape, truth, batch, context):
    return [{"method": "eagle3", "k": 7, "batch": batch, "context": context,
             "ar_step_ms": step_cost(shape, truth, 1, 1, batch, context).total_s * 1e3,
             "verify_step_ms": {str(k): step_cost(shape, truth, 1, k + 1, batch, context).total_s * 1e3
                                for k in range(1, 8)},
             "draft_step_ms": {"3": 0.4}}]


def test_calibration_recovers_step_times(smol):
    hw = load_profile("h200")
    truth = replace(hw, memory_efficiency=0.5, compute_efficiency=0.4, layer_overhead_s=45e-6)
    recs = _records(smol, truth, 1, 512) + _records(smol, truth, 64, 512)
    cal = calibrate(recs, smol, hw, tp=1, context=512)
    assert cal.max_relative_error < 0.01
    assert cal.memory_efficiency == pytest.approx(0.5, rel=0.1)
    assert cal.draft_round_s == {"eagle3": {3: pytest.approx(4e-4)}}
    fitted = cal.apply(hw)
    for n in (1, 3, 8):
        want = step_cost(smol, truth, 1, n, 8, 512).total_s
        assert step_cost(smol, fitted, 1, n, 8, 512).total_s == pytest.approx(want, rel=0.02)


def test_calibration_recovers_a_verification_round_trip(smol):
    """Plain steps pipelined (no host round trip), verification steps paying one: the fit names it."""
    hw = load_profile("h200")
    truth = replace(hw, memory_efficiency=0.3, compute_efficiency=0.3, token_overhead_s=50e-6, verify_overhead_s=4e-4)
    cal = calibrate(_records(smol, truth, 1, 512), smol, hw, tp=1, context=512)
    assert cal.max_relative_error < 0.02
    assert cal.verify_overhead_s == pytest.approx(4e-4, rel=0.15)
    assert step_cost(smol, cal.apply(hw), 1, 1, 1, 512).term_s("acceptance round trip") == 0.0
    fitted = cal.apply(hw)
    for n in (1, 2, 5, 8):
        want = step_cost(smol, truth, 1, n, 1, 512).total_s
        assert step_cost(smol, fitted, 1, n, 1, 512).total_s == pytest.approx(want, rel=0.03)


def test_calibration_needs_step_times(smol):
    hw = load_profile("h200")
    with pytest.raises(UserError, match="ar_step_ms"):
        calibrate([{"method": "eagle3", "k": 3, "tau": 2.5, "speedup_vs_ar": 2.0}], smol, hw)
    with pytest.raises(UserError, match="verify_step_ms"):
        calibrate([{"method": "eagle3", "k": 3, "ar_step_ms": 1.5}], smol, hw)
    with pytest.raises(UserError, match="integer 'k'"):
        calibrate([{"method": "eagle3", "ar_step_ms": 1.5, "verify_step_ms": 1.6}], smol, hw)
    with pytest.raises(UserError, match="positive"):
        calibrate([{"method": "eagle3", "k": 3, "ar_step_ms": -1, "verify_step_ms": 1.6}], smol, hw)
    cal = calibrate([{"method": "eagle3", "k": 3, "ar_step_ms": 1.53, "verify_step_ms": 1.6}], smol, hw)
    assert cal.max_relative_error < 0.05


def test_calibration_from_measured_inputs(kimi):
    hw = load_profile("rtx-pro-6000")
    cal = calibrate_measured(kimi, hw, 8, single_stream_tokens_per_s=60.0, allreduce_share=0.5,
                             collectives_per_token=122)
    fitted = cal.apply(hw)
    cost = step_cost(kimi, fitted, 8, 1, 1, 2048)
    assert cost.total_s == pytest.approx(1 / 60.0, rel=1e-6)
    assert cost.term_s("AllReduce") == pytest.approx(0.5 / 60.0, rel=1e-6)
    assert fitted.collectives_per_layer == pytest.approx(2.0)
    # faster than the modelled reads: efficiencies rise (at most to 1) and the overhead vanishes
    quick = calibrate_measured(kimi, hw, 8, single_stream_tokens_per_s=400.0, allreduce_share=0.2)
    assert quick.memory_efficiency > hw.memory_efficiency and quick.step_overhead_s == 0.0
    with pytest.raises(UserError, match="allreduce_share"):
        calibrate_measured(kimi, hw, 8, single_stream_tokens_per_s=10_000.0)
    with pytest.raises(UserError):
        calibrate_measured(kimi, hw, 1, 60.0, allreduce_share=0.3)
    with pytest.raises(UserError):
        calibrate_measured(kimi, hw, 8, 0.0)


def test_calibration_reads_bench_records_as_written(smol):
    """`outrider bench --json` records: scalar step times at the record's k, an `ar` record, batch_size."""
    hw = load_profile("h200")
    truth = replace(hw, memory_efficiency=0.6, layer_overhead_s=40e-6)
    ar_ms = step_cost(smol, truth, 1, 1, 1, 2048).total_s * 1e3
    recs = [{"method": "ar", "k": 0, "batch_size": 1, "verify_step_ms": ar_ms, "ar_step_ms": ar_ms,
             "accept_rate_per_pos": [], "tau": 1.0}]
    for k in (1, 3, 7):
        recs.append({"method": "ngram", "k": k, "batch_size": 1, "ar_step_ms": ar_ms, "propose_step_ms": 0.05,
                     "verify_step_ms": step_cost(smol, truth, 1, k + 1, 1, 2048).total_s * 1e3,
                     "speedup_vs_ar": 99.0})
    cal = calibrate(recs, smol, hw)
    assert cal.max_relative_error < 0.01 and len(cal.points) == 4
    assert cal.draft_round_s == {"ngram": {1: 5e-5, 3: 5e-5, 7: 5e-5}}
