"""Every strategy (``decode.strategies``) emits exactly what the reference step emits.

On the CPU in float32, over the static cache (``read_len="max"``: the GPU's slot arithmetic):
plain greedy chunks, a device-side proposer pipelined and in device rounds (``Scripted``, which
accepts every length, and EAGLE-3 chains), EAGLE-3 trees (dynamic and static) pipelined, against
``SpecEngine.step`` alone: the tokens, the counts and the steps must be identical.
"""

from __future__ import annotations

import pytest
from test_eagle3_proposer import _head
from test_engine import MAX_NEW, _hf_greedy, _prompts
from test_spec_rounds import Scripted

from outrider.decode.engine import SpecEngine
from outrider.decode.draft import Draft
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.decode.strategies import choose
from outrider.decode.strategies.ar_chunks import GreedyChunks
from outrider.decode.strategies.pipelined import PipelinedStep
from outrider.decode.strategies.rounds import RoundChunks
from outrider.trees import TreeBudget, static_tree


def _run(model, method, rounds, reference, monkeypatch, batch):
    chosen = []

    def pick(engine, target):
        strategy = choose(engine, target)
        chosen.append(type(strategy))
        return (lambda state: engine.step(state, target)) if reference else strategy

    monkeypatch.setattr("outrider.decode.engine.choose", pick)
    prompts, out = _prompts(), []
    proposer = {"ar": lambda: None, "eagle3": lambda: Eagle3Proposer(_head(model), model),
                "eagle3-tree": lambda: Eagle3Proposer(_head(model), model, tree=TreeBudget(3, 3, 8)),
                "eagle3-static": lambda: Eagle3Proposer(_head(model), model, tree=static_tree(
                    "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]")),
                "scripted": lambda: Scripted([_hf_greedy(model, p, MAX_NEW) for p in prompts],
                                             model.config.vocab_size)}[method]()
    engine = SpecEngine(model, proposer, k=3, read_len="max", rounds=rounds)
    for i in range(0, len(prompts), batch):
        r = engine.generate(prompts[i:i + batch], MAX_NEW)
        out.append((r.tokens, r.steps, r.row_steps, r.proposed, r.accepted))
    return out, chosen[0]


@pytest.mark.parametrize("method, rounds, strategy, batch", [
    ("ar", 8, GreedyChunks, 3), ("scripted", 0, PipelinedStep, 3), ("scripted", 8, RoundChunks, 3),
    ("eagle3", 0, PipelinedStep, 1), ("eagle3", 8, RoundChunks, 1), ("eagle3-tree", 8, PipelinedStep, 3),
    ("eagle3-static", 8, PipelinedStep, 1)])  # Scripted knows the batch of all prompts
def test_every_strategy_emits_what_the_reference_step_emits(tiny_models, monkeypatch, method, rounds, strategy,
                                                             batch):
    model = tiny_models("llama")
    got, chosen = _run(model, method, rounds, False, monkeypatch, batch)
    want, _ = _run(model, method, rounds, True, monkeypatch, batch)
    assert chosen is strategy
    assert got == want  # tokens, steps (a chunk of n greedy steps counts n), drafts proposed and accepted
    assert method != "scripted" or sum(a for *_, acc in got for a in acc) > 0  # drafts were accepted


def test_a_chain_is_a_draft_tree_and_one_verification_takes_both():
    import torch

    from outrider.decode.sampling import RowRandom, SamplingParams
    from outrider.decode.verify import verify

    draft = Draft.chain(torch.tensor([[5, 6, 7]]), torch.tensor([3]))
    assert draft.parents.tolist() == [-1, 0, 1] and draft.is_chain() and draft.levels == 3
    assert draft.ancestors[0].tolist() == torch.ones(3, 3, dtype=torch.bool).tril().tolist()
    tree = Draft(draft.tokens, torch.tensor([-1, 0, 0]), draft.num)
    assert not tree.is_chain() and tree.depths.tolist() == [[1, 2, 2]] and tree.siblings == 2
    logits = torch.zeros(1, 4, 10)
    logits[0, 0, 5] = logits[0, 1, 7] = logits[0, 3, 1] = 1.0  # root wants 5, node 0 wants 7 (node 2), node 2 wants 1
    for d, acc, out in ((draft, 1, [5, 7]), (tree, 2, [5, 7, 1])):
        v = verify(d, logits, SamplingParams(), RowRandom(1, 0))
        assert v.num_accepted.tolist() == [acc] and v.tokens[0, :acc + 1].tolist() == out
