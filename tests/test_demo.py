"""The demo's choices: the chain length it picks from a measured record, the CPU summary's
explanation, which states the measured cost ratios and the planner's GPU prediction, the GPU
summary's, which states a round's cost, the bound it sets and the trainer's walked tau beside the bench's,
and the training budget, which takes what a budgeted data stage left."""

import json

import pytest

from outrider import sharegpt
from outrider.demo import SIZES, ar_record, choose_k, cpu_explanation, last_walk, speed_explanation, train_budget


def _record(rates, verify_ms, draft_ms, k=5):
    return {"method": "eagle3", "k": k, "accept_rate_per_pos": rates, "verify_step_ms": verify_ms,
            "draft_step_ms": draft_ms, "ar_step_ms": 1.0, "tau": 1 + sum(rates)}


def test_choose_k_weighs_acceptance_against_the_drafting_cost():
    # drafting free, acceptance high: the longest chain considered wins
    assert choose_k(_record([0.9] * 5, verify_ms=1.0, draft_ms=1e-6)) == 8
    # each draft step as dear as a verification, acceptance poor: one or two drafts at most
    assert choose_k(_record([0.3, 0.2, 0.1, 0.1, 0.1], verify_ms=1.0, draft_ms=5.0)) == 2
    # the bench's rates are unconditional (P(draft i accepted), summing to tau - 1): the H100 demo's
    # k = 5 record (33e4d0b) predicts k = 5 fastest, as its benches of k = 3 and 7 beside it measured
    # (benchmarks/results/gpu/h100-2026-12-06-33e4d0b/trees-chain-k*.json)
    h100 = _record([0.598, 0.406, 0.285, 0.199, 0.149], verify_ms=1.506, draft_ms=0.467)
    assert choose_k(h100) == 5
    # a record without step costs keeps its own k
    assert choose_k({"k": 4, "accept_rate_per_pos": [0.5] * 4}) == 4


def test_cpu_explanation_states_the_measured_ratios_and_a_gpu_prediction(tmp_path):
    rec = _record([0.2, 0.05, 0.01, 0.0, 0.0], verify_ms=2.5, draft_ms=1.5)
    rec.update(ar_tokens_per_s=10.0, tokens_per_s=5.0, speedup_vs_ar=0.5, num_prompts=6, new_tokens=100,
               lossless=True, device="cpu", dtype="float32", batch_size=1)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([rec]))
    text = "\n".join(cpu_explanation(rec, path))
    assert "costs 2.50x a plain decoding step" in text and "another 1.50x" in text
    assert "it would need more than 4.00 to pay" in text  # tau 1.26 against 2.5 + 1.5
    rec.update(tau=1.25, verify_step_ms=1.1, draft_step_ms=0.1, speedup_vs_ar=1.03)
    text = "\n".join(cpu_explanation(rec, path))
    assert "just above the 1.20 it needs to pay, hence 1.03x" in text
    assert "The planner predicts" in text and "H200" in text


def test_the_gpu_explanation_states_the_rounds_cost_the_bound_and_the_walked_tau(tmp_path):
    # the H100 demo of 33e4d0b: tau 2.63, verification 1.51 ms, drafting 0.47 ms, a plain step 1.26 ms
    rec = _record([0.598, 0.406, 0.285, 0.199, 0.149], verify_ms=1.51, draft_ms=0.47)
    rec.update(ar_step_ms=1.26, tau=2.63, speedup_vs_ar=1.67, decode_speedup_vs_ar=1.70)
    text = "\n".join(speed_explanation(rec, (5, 3.07)))
    assert "costs 1.57 plain decoding steps" in text  # (1.51 + 0.47) / 1.26
    assert "at most 1.67x in decode, measured 1.70x (1.67x end to end)" in text  # 2.63 / 1.571
    assert "2x in decode needs tau >= 3.14" in text
    assert "walked tau on its eval split (texts held out by opening) was 3.07 (the same k) against the bench's 2.63" in text
    assert "k = 6, the bench's is 5" in "\n".join(speed_explanation(rec, (6, 3.07)))
    assert "walked" not in "\n".join(speed_explanation(rec, None))


def test_last_walk_reads_the_saved_heads_evaluation(tmp_path):
    assert last_walk(tmp_path) is None  # no run here
    (tmp_path / "train_config.json").write_text(json.dumps({"config": {"tau_k": 5}}))
    rows = [{"type": "train", "step": 1}, {"type": "eval", "step": 500, "walk_tau_k": 2.4},
            {"type": "eval", "step": 900, "sim_tau_k": 2.9}, {"type": "eval", "step": 1000, "walk_tau_k": 2.7}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"type": "ev')
    assert last_walk(tmp_path) == (5, 2.7)  # none marked best: the last; a torn last line skipped
    rows[1]["best"] = True
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert last_walk(tmp_path) == (5, 2.4)  # the saved head's evaluation
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert last_walk(tmp_path) is None  # no evaluation walked


def test_the_ar_row_carries_the_ar_passes_and_none_of_the_methods_figures():
    paired = _record([0.5, 0.2], verify_ms=1.4, draft_ms=0.3, k=2)
    paired.update(ar_tokens_per_s=20.0, tokens_per_s=30.0, speedup_vs_ar=1.5, decode_speedup_vs_ar=1.6,
                  speedup_per_pass=[1.5], step_ms=1.7, prefill_ms=9.0, ar_prefill_ms=8.0, greedy_agreement=0.9,
                  propose_step_ms=0.3)
    ar = ar_record(paired)
    assert ar["method"] == "ar" and ar["tokens_per_s"] == 20.0 and ar["tau"] == 1.0
    assert ar["speedup_vs_ar"] == ar["decode_speedup_vs_ar"] == 1.0 and ar["speedup_per_pass"] == [1.0]
    assert ar["verify_step_ms"] == ar["step_ms"] == ar["ar_step_ms"] and ar["prefill_ms"] == 8.0
    assert "greedy_agreement" not in ar and "propose_step_ms" not in ar


def test_training_exchanges_hold_out_benchmark_prompts(tmp_path):
    held_id = next(f"h{i}" for i in range(1000) if sharegpt.heldout(f"h{i}"))
    kept_id = next(f"k{i}" for i in range(1000) if not sharegpt.heldout(f"k{i}"))
    turns = [{"from": "human", "value": "a benchmark prompt"}, {"from": "gpt", "value": "a reply"},
             {"from": "human", "value": "more"}, {"from": "gpt", "value": "another"}]
    corpus = sharegpt.ShareGPT(path=tmp_path / "sharegpt.json", conversations=[
        {"id": held_id, "conversations": turns},
        {"id": kept_id, "conversations": turns},  # opens with the held-out prompt: held out too
        {"id": kept_id + "x", "conversations": [{"from": "human", "value": "fresh"}] + turns[1:]},
    ], complete=3, truncated=False, dropped_bytes=0, dropped_records=0, note="")
    out = sharegpt.training_exchanges(corpus, first=5, later=5)
    assert [r["id"] for r in out] == [kept_id + "x", kept_id + "x#2"]
    assert [len(r["conversations"]) for r in out] == [2, 4]


def test_single_exchanges_are_later_prompts_alone_each_prompt_once_none_held_out(tmp_path):
    held_id = next(f"h{i}" for i in range(1000) if sharegpt.heldout(f"h{i}"))
    ids = [f"k{i}" for i in range(1000) if not sharegpt.heldout(f"k{i}")][:3]

    def conv(cid, *texts):
        return {"id": cid, "conversations": [{"from": ("human", "gpt")[i % 2], "value": t} for i, t in enumerate(texts)]}

    corpus = sharegpt.ShareGPT(path=tmp_path / "sharegpt.json", conversations=[
        conv(held_id, "the benchmark prompt", "r", "held-out follow-up", "r"),
        conv(ids[0], "opening one", "r1", "Shorter please", "r2", "the  BENCHMARK prompt", "r3", "opening two", "r4"),
        conv(ids[1], "opening two", "r1", "shorter please", "r2", "a new ask", "r3"),
        conv(ids[2], "opening three", "r1", "last ask", ""),
    ], complete=4, truncated=False, dropped_bytes=0, dropped_records=0, note="")
    out = sharegpt.training_exchanges(corpus, first=5, later=1, single=10)
    assert [r["id"] for r in out] == [ids[0], ids[1], ids[2], ids[0] + "#s2", ids[1] + "#s4", ids[2] + "#s2",
                                      ids[0] + "#2"]
    assert out[3]["conversations"] == [{"from": "human", "value": "Shorter please"}, {"from": "gpt", "value": "r2"}]
    assert [r["id"] for r in sharegpt.training_exchanges(corpus, first=1, single=2)] == [ids[0], ids[0] + "#s2",
                                                                                          ids[0] + "#s6"]


def test_the_summary_shows_each_rows_lossless_verdict(tmp_path):
    from outrider.demo import _summary
    from outrider.bench.verdict import Verdict

    paired = _record([0.6, 0.4], verify_ms=1.4, draft_ms=0.3, k=2)
    paired.update(ar_tokens_per_s=20.0, tokens_per_s=30.0, speedup_vs_ar=1.5, device="NVIDIA H100",
                  dtype="bfloat16", **Verdict("near-ties", 3, 0.125, 1.0).record())
    ngram = dict(paired, method="ngram", **Verdict("NO", 0, None, 1.0, {"prompt": 2, "token": 9, "margin": 6.5}).record())
    text = _summary("full", [ar_record(paired), ngram, paired], {"bench": 1.0}, "exported", tmp_path / "b.json")
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[1].endswith("| reference |") and rows[2].endswith("| NO |") and rows[3].endswith("| ties 3 |")
    assert "lossless, ngram k = 2: NO: prompt 2, token 9, margin 6.5" in text
    assert "lossless, eagle3 k = 2: equal up to 3 near-ties (largest margin 0.125, bound 1)" in text
    assert "## Where the speed-up comes from" in text and "walked" not in text  # a GPU run; no training log given
    text = _summary("full", [ar_record(paired), ngram, paired], {"bench": 1.0}, "exported", tmp_path / "b.json", (2, 2.5))
    assert "was 2.50 (the same k) against the bench's 2.00" in text


def test_every_demo_preset_is_offered_and_trains_with_a_known_preset():
    from outrider.cli import build_parser
    from outrider.config import PRESETS
    from outrider.demo import SIZES

    for name in SIZES:
        assert build_parser().parse_args(["demo", "--preset", name]).preset == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--preset", "huge"])
    assert all(size.train_preset in PRESETS for size in SIZES.values())
    for name in ("short", "long"):  # budgeted GPU presets: the bench keeps its minutes of the 25
        size = SIZES[name]
        assert 0 < size.regen_budget_s and 0 < size.train_budget_s
        assert size.regen_budget_s + size.train_budget_s <= 1000, name
    assert SIZES["full"].regen_budget_s == 0  # full: every exchange asked


def _manifest(tmp_path, **regen):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "outrider-tokens", "regenerate": regen}))
    return tmp_path


@pytest.mark.parametrize("regen, expected", [
    ({"budget_s": 450.0, "seconds": 382.3, "over_budget": 0}, 480.0 + 450.0 - 382.3),  # exchanges ran out first
    ({"budget_s": 450.0, "seconds": 450.4, "over_budget": 18879}, 480.0),  # the budget ran out first
    ({"budget_s": 450.0, "seconds": 449.6, "over_budget": 0}, 480.0),  # both at once: under a second left
    ({"seconds": 200.0}, 480.0),  # no budget recorded
])
def test_the_long_preset_trains_for_what_the_data_stage_left_of_its_budget(tmp_path, regen, expected):
    seconds, note = train_budget(SIZES["long"], _manifest(tmp_path, **regen))
    assert seconds == pytest.approx(expected)
    assert f"{expected:.0f} s" in note
    if expected > 480.0:
        assert "68 s the data stage left" in note


def test_presets_without_a_training_budget_keep_the_training_presets_own(tmp_path):
    data = _manifest(tmp_path, budget_s=450.0, seconds=100.0, over_budget=0)
    assert train_budget(SIZES["full"], data) == (0.0, "")
    assert train_budget(SIZES["quick"], data) == (0.0, "")
