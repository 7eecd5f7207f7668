"""Planner: EAGLE-2 draft trees (SGLang's budget), parallel drafting and DFlash blocks, priced and recommended."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
from rich.console import Console

from outrider.errors import UserError
from outrider.models import arch_info
from outrider.plan.acceptance import Acceptance
from outrider.plan.calibrate import calibrate
from outrider.plan.cost_model import (
    ModelShape,
    dflash_shape,
    draft_round_cost,
    eagle3_head_shape,
    predict,
    step_cost,
)
from outrider.plan.hardware import load_profile, parse_precision
from outrider.plan.planner import _dflash_shape, acceptance_from_bench, plan, trees_from_bench
from outrider.plan.presets import KIMI_K25, SMOLLM2_135M
from outrider.plan.trees import predict_tree, tree_round_cost
from outrider.trees import TreeBudget, budget_of, static_tree
from tests.tiny import tiny_config


def quiet():
    buf = io.StringIO()
    return Console(file=buf, width=220), buf


@pytest.fixture(scope="module")
def smol():
    return ModelShape.from_arch(SMOLLM2_135M)


@pytest.fixture(scope="module")
def kimi():
    return ModelShape.from_arch(KIMI_K25, parse_precision("int4-g32/bf16"))


def write(tmp_path, records, name="bench.json"):
    path = tmp_path / name
    path.write_text(json.dumps(records))
    return str(path)


# ---- cost of a round -------------------------------------------------------------------------

@pytest.mark.parametrize("topk,steps,tokens,batch", [(2, 3, 6, 1), (4, 4, 16, 8), (8, 2, 40, 4)])
def test_tree_round_is_steps_draft_forwards_plus_one_verify(smol, topk, steps, tokens, batch):
    hw, ctx = load_profile("h200"), 1024
    head = eagle3_head_shape(SMOLLM2_135M)
    budget = TreeBudget(topk, steps, tokens)
    # independently: the first draft forward is today's one-token chain round (fc included) ...
    fc = draft_round_cost(head, hw, 1, 1, batch, ctx).total_s - step_cost(head.shape, hw, 1, 1, batch, ctx,
                                                                           include_step_overhead=False).total_s
    assert fc > 0
    first = step_cost(head.shape, hw, 1, 1, batch, ctx, include_step_overhead=False).total_s + fc
    # ... each later one over topk nodes per sequence
    later = (steps - 1) * step_cost(head.shape, hw, 1, topk, batch, ctx, include_step_overhead=False).total_s
    verify = step_cost(smol, hw, 1, tokens, batch, ctx).total_s
    assert tree_round_cost(head, hw, 1, budget, batch, ctx).total_s == pytest.approx(first + later, rel=1e-12)
    p = predict_tree(smol, hw, head, budget, 2.5, batch, 1, ctx)
    assert p.verify_step_s == verify and p.draft_round_s == pytest.approx(first + later, rel=1e-12)
    assert p.tokens_per_s == pytest.approx(batch * 2.5 / (verify + first + later), rel=1e-12)
    assert p.expected_tokens == 2.5 and p.tree == (topk, steps, tokens) and p.draft_kind == "tree"
    assert p.launch.endswith(f"--speculative-eagle-topk {topk} --speculative-num-steps {steps} "
                             f"--speculative-num-draft-tokens {tokens}")


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("batch", [1, 16])
def test_topk1_tree_is_the_chain_exactly(smol, k, batch):
    hw = load_profile("h200")
    head = eagle3_head_shape(SMOLLM2_135M)
    acc = Acceptance.from_rates([0.8, 0.7, 0.6])
    chain = predict(smol, hw, head, acc, k, batch, 1, 2048)
    tree = predict_tree(smol, hw, head, TreeBudget(1, k, k + 1), acc.expected_tokens(k), batch, 1, 2048)
    for f in ("verify_step_s", "draft_round_s", "tokens_per_s", "ar_tokens_per_s", "speedup", "expected_tokens"):
        assert getattr(tree, f) == getattr(chain, f), f
    # measured rounds too: a topk-1 budget takes the chain's measured round of k = steps
    measured = replace(head, measured_round_s={k: 1e-3})
    assert tree_round_cost(measured, hw, 1, TreeBudget(1, k, k + 1), batch, 2048).total_s == 1e-3


def test_a_measured_tree_prices_the_levels_of_another_of_its_topk(smol):
    """A measured round of (4, 3, 16) prices (4, 4, 16): the first step as before, then each later
    level at the measured round's cost per level; another topk, or none measured, keeps the model."""
    hw, ctx = load_profile("h100"), 2048
    head = replace(eagle3_head_shape(SMOLLM2_135M), measured_round_s={1: 0.2e-3, 5: 0.5e-3})
    first = tree_round_cost(head, hw, 1, TreeBudget(1, 1, 2), 1, ctx).total_s
    assert first == pytest.approx(0.2e-3)
    measured = replace(head, measured_tree_round_s={(4, 3, 16): 1.0e-3})
    level = (1.0e-3 - first) / 2
    assert tree_round_cost(measured, hw, 1, TreeBudget(4, 4, 16), 1, ctx).total_s == pytest.approx(first + 3 * level)
    assert tree_round_cost(measured, hw, 1, TreeBudget(4, 3, 16), 1, ctx).total_s == pytest.approx(1.0e-3)
    modelled = tree_round_cost(head, hw, 1, TreeBudget(2, 4, 10), 1, ctx).total_s
    assert tree_round_cost(measured, hw, 1, TreeBudget(2, 4, 10), 1, ctx).total_s == modelled
    at8 = replace(measured, measured_tree_round_by_batch={((4, 3, 16), 8): 1.6e-3})
    first8 = tree_round_cost(at8, hw, 1, TreeBudget(1, 1, 2), 8, ctx).total_s
    assert tree_round_cost(at8, hw, 1, TreeBudget(4, 4, 16), 8, ctx).total_s == pytest.approx(
        first8 + 3 * (1.6e-3 - first8) / 2)
    # at a batch with no tree measured, the nearest measured batch's levels, each less its own first step
    first1 = tree_round_cost(at8, hw, 1, TreeBudget(1, 1, 2), 1, ctx).total_s
    big = replace(head, measured_round_by_batch={(1, 32): 0.9e-3},
                  measured_tree_round_by_batch={((4, 3, 16), 1): 1.0e-3, ((2, 3, 10), 32): 9.0e-3})
    first32 = tree_round_cost(big, hw, 1, TreeBudget(1, 1, 2), 32, ctx).total_s
    assert first32 > 1.0e-3 - first1  # the batch-1 round less the batch-32 first step would clamp to nothing
    assert tree_round_cost(big, hw, 1, TreeBudget(4, 4, 16), 32, ctx).total_s == pytest.approx(
        first32 + 3 * (1.0e-3 - first1) / 2)


def test_plan_calibrates_on_several_bench_files(tmp_path):
    """``--calibrate A,B``: the records of both files fitted together (a chain's and a tree's), the
    tree's measured round pricing another budget of its topk."""
    common = {"ar_step_ms": 1.29, "num_prompts": 4, "batch_size": 1, "new_tokens": 128}
    chain = write(tmp_path, [{"method": "eagle3", "k": 5, "tau": 1.96, "verify_step_ms": 1.47,
                              "draft_step_ms": 0.48, **common}], "chain.json")
    tree = {"method": "eagle3", "k": 3, "tau": 2.44, "verify_step_ms": 1.80, "draft_step_ms": 0.90,
            "topk": 4, "steps": 3, "draft_tokens": 16, **common}
    trees = write(tmp_path, [tree], "tree.json")
    other = write(tmp_path, [{**tree, "steps": 4, "k": 4, "tau": 2.56, "draft_step_ms": 1.22}], "other.json")
    console, _ = quiet()
    result = plan("default", "h100", calibrate=f"{chain},{trees}", acceptance=other, console=console)
    (p,) = [p for p in result.predictions if p.tree == (4, 4, 16)]
    assert 1.0e-3 < p.draft_round_s < 1.6e-3  # the first step, then three levels at the measured level's cost
    with pytest.raises(UserError):
        plan("default", "h100", calibrate=f"{chain},{tmp_path / 'missing.json'}", acceptance=other, console=console)


@pytest.mark.parametrize("moe", ["tiny", "kimi"])
def test_wide_tree_verify_wakes_more_experts(moe, kimi):
    shape = ModelShape.from_arch(arch_info(tiny_config("deepseek_v3"))) if moe == "tiny" else kimi
    hw = load_profile("h200")
    head = eagle3_head_shape(KIMI_K25)
    tp = 1 if moe == "tiny" else 8
    chain = predict_tree(shape, hw, head, TreeBudget(1, 3, 4), 3.0, 1, tp)
    wide = predict_tree(shape, hw, head, TreeBudget(4, 3, 16), 3.0, 1, tp)
    assert wide.verify.term_s("routed-expert weights") > chain.verify.term_s("routed-expert weights")
    assert wide.verify_step_s > chain.verify_step_s
    assert wide.speedup < chain.speedup  # same tau: the tree only costs more


def test_parallel_round_is_one_draft_forward(smol):
    hw = load_profile("h200")
    head = eagle3_head_shape(SMOLLM2_135M)
    par = replace(head, method="parallel")
    for k, b in ((1, 1), (4, 1), (6, 32)):
        fc = draft_round_cost(head, hw, 1, 1, b, 512).total_s - step_cost(head.shape, hw, 1, 1, b, 512,
                                                                           include_step_overhead=False).total_s
        one = step_cost(head.shape, hw, 1, k, b, 512, include_step_overhead=False).total_s
        assert draft_round_cost(par, hw, 1, k, b, 512).total_s == pytest.approx(one + fc, rel=1e-12)
        p = predict(smol, hw, par, Acceptance.from_rates([0.7]), k, b, 1, 512)
        assert p.verify_step_s == step_cost(smol, hw, 1, k + 1, b, 512).total_s and p.draft_kind == "parallel"
    assert draft_round_cost(par, hw, 1, 5, 1, 512).total_s < draft_round_cost(head, hw, 1, 5, 1, 512).total_s


def test_dflash_round_is_one_forward_of_its_layers_over_k_plus_one(smol):
    hw = load_profile("h200")
    head = eagle3_head_shape(SMOLLM2_135M)
    one_layer, three = dflash_shape(SMOLLM2_135M, 1), dflash_shape(SMOLLM2_135M, 3)
    assert three.shape.num_layers == 3 and three.shape.attn_params < head.shape.attn_params  # q/k/v over H, not 2H
    for k, b in ((1, 1), (4, 1), (7, 32)):
        fc = _roofline_fc(three, hw, b)
        block = step_cost(three.shape, hw, 1, k + 1, b, 512, include_step_overhead=False).total_s
        assert draft_round_cost(three, hw, 1, k, b, 512).total_s == pytest.approx(block + fc, rel=1e-12)
        p = predict(smol, hw, one_layer, Acceptance.from_rates([0.7]), k, b, 1, 512)
        assert p.draft_kind == "block" and p.verify_step_s == step_cost(smol, hw, 1, k + 1, b, 512).total_s
    assert draft_round_cost(one_layer, hw, 1, 7, 1, 512).total_s < draft_round_cost(head, hw, 1, 7, 1, 512).total_s
    mha = dflash_shape(SMOLLM2_135M, 1, kv_heads=SMOLLM2_135M.num_heads)  # its own kv heads: 9 where the target has 3
    hd = SMOLLM2_135M.head_dim
    assert mha.shape.attn_params - one_layer.shape.attn_params == 2 * SMOLLM2_135M.hidden_size * 6 * hd
    assert mha.shape.kv_elems_per_token == 2 * 9 * hd


def _roofline_fc(draft, hw, batch):
    """The fc term of a draft round (its cost at k = 1 minus the forward's)."""
    n = 2 if draft.method == "dflash" else 1
    return draft_round_cost(draft, hw, 1, 1, batch, 512).total_s - step_cost(
        draft.shape, hw, 1, n, batch, 512, include_step_overhead=False).total_s


def test_plan_compares_eagle3_parallel_and_dflash(tmp_path):
    records = [
        {"method": "eagle3", "k": 3, "tau": 2.2, "accept_rate_per_pos": [0.7, 0.5, 0.3]},
        {"method": "parallel", "k": 3, "tau": 2.0, "accept_rate_per_pos": [0.6, 0.4, 0.2]},
        {"method": "dflash", "k": 3, "tau": 2.1, "accept_rate_per_pos": [0.65, 0.4, 0.25]},
    ]
    result, rows, text = _plan(tmp_path, records, batches=[1], ks=[3])
    kinds = {(r["method"], r["draft"]) for r in rows}
    assert kinds == {("eagle3", "chain"), ("parallel", "parallel"), ("dflash", "block")}
    dflash = next(r for r in rows if r["method"] == "dflash")
    assert '"method": "dflash"' in dflash["launch"] and dflash["expected_tokens"] == pytest.approx(
        Acceptance.from_rates([0.65, 0.4, 0.25]).expected_tokens(3))
    assert "dflash" in text


def test_plan_keeps_dflash_within_its_block(tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "block_size": 4,
                                                    "num_key_value_heads": SMOLLM2_135M.num_heads}))
    records = [{"method": "dflash", "k": 3, "tau": 2.1, "accept_rate_per_pos": [0.65, 0.4, 0.25],
                "draft": str(folder)}]
    _, rows, _ = _plan(tmp_path, records, batches=[1], ks=[2, 3, 4, 5])
    assert sorted(r["k"] for r in rows) == [2, 3]
    assert _dflash_shape(write(tmp_path, records)) == (2, 4, SMOLLM2_135M.num_heads)  # priced with its own kv heads


# ---- records ---------------------------------------------------------------------------------

def test_tree_paths_and_budget_bound():
    assert TreeBudget(*static_tree("[(0,), (1,), (0, 0)]").shape()) == TreeBudget(2, 2, 4)
    assert TreeBudget(*static_tree("[(0,), (0, 0), (0, 0, 0)]").shape()) == TreeBudget(1, 3, 4)  # the chain of 3
    assert TreeBudget(2, 3, 11).max_draft_tokens == 11 and TreeBudget(1, 5, 6).max_draft_tokens == 6
    assert budget_of({"tree_paths": "[(0,), (1,), (2,), (0, 0), (0, 1)]", "verified_tokens": 6}, "t") == \
        TreeBudget(3, 2, 6)


BAD = [
    ({"topk": 0, "steps": 3, "draft_tokens": 4, "tau": 2.0}, "'topk' must be >= 1"),
    ({"topk": 2, "steps": 3, "draft_tokens": 12, "tau": 2.0}, "draft_tokens 12 is impossible"),
    ({"topk": 2, "steps": 3, "draft_tokens": 1, "tau": 1.0}, "draft_tokens 1 is impossible"),
    ({"topk": 2, "steps": 3, "draft_tokens": 6}, "needs 'tau'"),
    ({"topk": 2, "steps": 3, "draft_tokens": 6, "tau": 4.5}, "tau 4.5 is impossible"),
    ({"topk": 2, "steps": 3, "draft_tokens": 6, "tau": "x"}, "'tau' must be a number"),
    ({"topk": 2, "steps": 3, "draft_tokens": 6, "tau": 2.0, "verified_tokens": 5}, "'verified_tokens' 5"),
    ({"topk": 2, "steps": 3, "draft_tokens": 6, "tau": 2.0, "accept_rate_per_pos": [0.8, 0.5, 0.3, 0.1]},
     "at most steps=3"),
    ({"topk": 1, "steps": 3, "draft_tokens": 3, "tau": 2.0}, "topk 1 is a chain"),
    ({"topk": 2, "steps": "3", "draft_tokens": 6, "tau": 2.0}, "integer 'steps'"),
    ({"tree_paths": "[(0,), (1, 0)]", "tau": 2.0}, "no parent"),
    ({"tree_paths": "[(0,), (1,)", "tau": 2.0}, "not a list of paths"),
    ({"tree_paths": "[(0,), (1,)]", "topk": 3, "tau": 2.0}, "disagrees with its tree_paths"),
]


@pytest.mark.parametrize("record,needle", BAD)
def test_bad_tree_records_are_one_line_errors(tmp_path, record, needle):
    path = write(tmp_path, [{"method": "eagle3", **record}])
    with pytest.raises(UserError) as e:
        trees_from_bench(path)
    assert needle in str(e.value) and "\n" not in str(e.value) and "record 0" in str(e.value)
    with pytest.raises(UserError):
        plan("default", "h200", acceptance=path, console=quiet()[0])


def test_bench_file_with_chains_and_trees(tmp_path):
    path = write(tmp_path, [
        {"method": "ar", "k": 0, "tau": 1.0},
        {"method": "eagle3", "k": 3, "tau": 2.6, "accept_rate_per_pos": [0.8, 0.6, 0.4]},
        {"method": "eagle3", "topk": 4, "steps": 3, "draft_tokens": 8, "tau": 2.9, "verified_tokens": 8,
         "accept_rate_per_pos": [0.9, 0.7, 0.3]},
        {"method": "eagle3", "topk": 1, "steps": 5, "draft_tokens": 6, "tau": 3.0},  # the chain k=5
        {"method": "eagle3", "tree_paths": "[(0,), (1,), (0, 0)]", "tau": 2.1},
        {"method": "parallel", "k": 4, "tau": 2.4, "accept_rate_per_pos": [0.7, 0.5, 0.2, 0.0]},
    ])
    chains, trees = acceptance_from_bench(path), trees_from_bench(path)
    assert sorted(chains) == ["eagle3", "parallel"] and sorted(chains["eagle3"]) == [3, 5]
    assert chains["eagle3"][5].expected_tokens(5) == pytest.approx(3.0)
    assert sorted(trees["eagle3"]) == [TreeBudget(2, 2, 4), TreeBudget(4, 3, 8)]
    assert trees["eagle3"][TreeBudget(4, 3, 8)].tau == 2.9
    only_trees = write(tmp_path, [{"method": "eagle3", "topk": 2, "steps": 2, "draft_tokens": 5, "tau": 2.0}], "t.json")
    assert acceptance_from_bench(only_trees) == {} and len(trees_from_bench(only_trees)["eagle3"]) == 1


# ---- plan ------------------------------------------------------------------------------------

def _plan(tmp_path, records, target="default", hw="h200", **kw):
    out = tmp_path / "rows.json"
    console, buf = quiet()
    result = plan(target, hw, acceptance=write(tmp_path, records), json_path=str(out), console=console, **kw)
    return result, json.loads(out.read_text()), buf.getvalue()


def test_plan_rows_name_sglang_flags_and_pick_the_fastest(tmp_path):
    records = [
        {"method": "eagle3", "k": 3, "tau": 2.2, "accept_rate_per_pos": [0.7, 0.5, 0.3]},
        {"method": "eagle3", "topk": 4, "steps": 3, "draft_tokens": 8, "tau": 3.6},
        {"method": "parallel", "k": 3, "tau": 2.0, "accept_rate_per_pos": [0.6, 0.4, 0.2]},
    ]
    result, rows, text = _plan(tmp_path, records, batches=[1, 64], ks=[2, 3])
    kinds = {(r["method"], r["draft"], r["k"], r["batch"]) for r in rows}
    assert kinds == {(m, d, k, b) for b in (1, 64) for m, d, k in
                     (("eagle3", "chain", 2), ("eagle3", "chain", 3), ("eagle3-tree", "tree", 7),
                      ("parallel", "parallel", 2), ("parallel", "parallel", 3))}
    tree = next(r for r in rows if r["draft"] == "tree" and r["batch"] == 1)
    assert (tree["topk"], tree["steps"], tree["draft_tokens"]) == (4, 3, 8) and tree["expected_tokens"] == 3.6
    assert "--speculative-eagle-topk 4 --speculative-num-steps 3 --speculative-num-draft-tokens 8" in tree["launch"]
    chain3 = next(r for r in rows if r["draft"] == "chain" and r["k"] == 3 and r["batch"] == 1)
    assert chain3["launch"].endswith("--speculative-eagle-topk 1 --speculative-num-steps 3 "
                                     "--speculative-num-draft-tokens 4")
    assert all(r["launch"] and "parallel_drafting" in r["launch"] for r in rows if r["draft"] == "parallel")
    for rec in result.recommendations:
        best = max((p for p in result.predictions if p.batch == rec.batch), key=lambda p: p.speedup)
        assert rec.speedup == best.speedup
        if rec.method is not None:
            assert rec.method == best.method and rec.launch == best.launch and rec.launch in rec.text
    assert "eagle3-tree" in text and "4,3,8" in text and "acceptance eagle3-tree" in text


def test_plan_picks_tree_chain_or_parallel_by_predicted_speed(tmp_path):
    chain = {"method": "eagle3", "k": 3, "tau": 2.5, "accept_rate_per_pos": [0.8, 0.6, 0.4]}
    # a tree at the chain's tau costs more (more verified tokens, more draft work): the chain wins
    same = {"method": "eagle3", "topk": 2, "steps": 3, "draft_tokens": 6, "tau": 2.5}
    r1, _, _ = _plan(tmp_path, [chain, same], target="kimi-k2.5", hw="h200", tp=8, ks=[3])
    assert r1.recommendations[0].method == "eagle3" and r1.recommendations[0].draft == "chain"
    # a tree that accepts much more wins, and the recommendation carries its SGLang budget
    better = dict(same, tau=3.9)
    r2, _, _ = _plan(tmp_path, [chain, better], target="kimi-k2.5", hw="h200", tp=8, ks=[3])
    rec = r2.recommendations[0]
    assert rec.method == "eagle3-tree" and rec.tree == (2, 3, 6) and rec.to_dict()["draft_tokens"] == 6
    assert "--speculative-num-draft-tokens 6" in rec.text
    # parallel drafting at the chain's tau drafts in one forward: it wins over both
    par = {"method": "parallel", "k": 3, "tau": 2.5, "accept_rate_per_pos": [0.8, 0.6, 0.4]}
    r3, _, _ = _plan(tmp_path, [chain, same, par], target="kimi-k2.5", hw="h200", tp=8, ks=[3])
    assert r3.recommendations[0].method == "parallel"


def test_plan_trees_lockstep_and_without_records(tmp_path):
    records = [{"method": "eagle3", "k": 3, "tau": 2.2, "accept_rate_per_pos": [0.7, 0.5, 0.3]},
               {"method": "eagle3", "topk": 2, "steps": 3, "draft_tokens": 6, "tau": 2.5,
                "accept_rate_per_pos": [0.8, 0.5, 0.2]}]
    result, rows, _ = _plan(tmp_path, records, batches=[1, 8], ks=[3], batching="lockstep")
    assert {r["batching"] for r in rows} == {"lockstep"} and sum(r["draft"] == "tree" for r in rows) == 2
    # no records: no tree and no parallel rows are invented
    plain = plan("default", "h200", tau=2.5, ks=[3], console=quiet()[0])
    assert {p.draft_kind for p in plain.predictions} == {"chain"}


def test_calibration_takes_tree_records(smol):
    hw = load_profile("h200")
    truth = replace(hw, memory_efficiency=0.5, compute_efficiency=0.4, layer_overhead_s=45e-6)
    recs = []
    for b in (1, 64):
        recs.append({"method": "eagle3", "k": 3, "batch": b, "context": 512,
                     "ar_step_ms": step_cost(smol, truth, 1, 1, b, 512).total_s * 1e3,
                     "verify_step_ms": step_cost(smol, truth, 1, 4, b, 512).total_s * 1e3})
        for topk, steps, n in ((4, 3, 16), (8, 4, 48)):
            recs.append({"method": "eagle3", "topk": topk, "steps": steps, "draft_tokens": n, "batch": b,
                         "context": 512, "verify_step_ms": step_cost(smol, truth, 1, n, b, 512).total_s * 1e3,
                         "draft_step_ms": 0.9 if b == 1 else 1.5})
    recs.append({"method": "eagle3", "topk": 1, "steps": 2, "draft_tokens": 3, "context": 512,
                 "verify_step_ms": step_cost(smol, truth, 1, 3, 1, 512).total_s * 1e3, "draft_step_ms": 0.3})
    cal = calibrate(recs, smol, hw, tp=1, context=512)
    assert cal.max_relative_error < 0.02
    assert {n for n, *_ in cal.points} == {1, 3, 4, 16, 48}
    assert cal.tree_round_s == {"eagle3": {(4, 3, 16): pytest.approx(9e-4), (8, 4, 48): pytest.approx(9e-4)}}
    assert cal.tree_round_by_batch["eagle3"][((4, 3, 16), 64)] == pytest.approx(1.5e-3)
    assert cal.draft_round_s == {"eagle3": {2: pytest.approx(3e-4)}}
    fitted = cal.apply(hw)
    for n in (1, 8, 16, 48):
        assert step_cost(smol, fitted, 1, n, 8, 512).total_s == pytest.approx(
            step_cost(smol, truth, 1, n, 8, 512).total_s, rel=0.03)
    bad = [dict(recs[1], verify_step_ms={"3": 1.0})]
    with pytest.raises(UserError, match="positive number of milliseconds"):
        calibrate(recs[:1] + bad, smol, hw, tp=1, context=512)
    with pytest.raises(UserError, match="draft_tokens 99 is impossible"):
        calibrate(recs + [dict(recs[1], draft_tokens=99)], smol, hw, tp=1, context=512)


def test_plan_uses_calibrated_tree_rounds(tmp_path):
    """--calibrate with tree records: the measured draft round of the budget replaces the model."""
    hw = load_profile("h200")
    smol = ModelShape.from_arch(SMOLLM2_135M)
    recs = [{"method": "eagle3", "k": 3, "tau": 2.2, "ar_step_ms": step_cost(smol, hw, 1, 1, 1, 2048).total_s * 1e3,
             "verify_step_ms": step_cost(smol, hw, 1, 4, 1, 2048).total_s * 1e3},
            {"method": "eagle3", "topk": 2, "steps": 3, "draft_tokens": 6, "tau": 2.5,
             "verify_step_ms": step_cost(smol, hw, 1, 6, 1, 2048).total_s * 1e3, "draft_step_ms": 0.777}]
    path = write(tmp_path, recs, "cal.json")
    result = plan("default", "h200", acceptance=path, calibrate=path, ks=[3], console=quiet()[0])
    tree = next(p for p in result.predictions if p.draft_kind == "tree")
    assert tree.draft_round_s == pytest.approx(0.777e-3)


def test_measured_acceptance_takes_chains_and_refuses_wide_trees():
    from outrider.plan.measured import read_measured

    m = read_measured({"acceptance": [{"method": "eagle3", "topk": 1, "steps": 3, "draft_tokens": 4, "tau": 2.5}]})
    assert m.acceptance["eagle3"][3].expected_tokens(3) == pytest.approx(2.5)
    with pytest.raises(UserError, match="give tree records with --acceptance"):
        read_measured({"acceptance": [{"method": "eagle3", "topk": 2, "steps": 3, "draft_tokens": 6, "tau": 2.5}]})
