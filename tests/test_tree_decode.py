"""Draft trees in SpecEngine: greedy tree decoding equals plain greedy decoding token for token
(float32, CPU; batch 1 and 4; GQA and MLA heads; dynamic and static trees), a topk-1 tree is the
chain, an accepted path through later branches commits only its own slots, and sampled tree
decoding follows the target distribution."""

from __future__ import annotations

import pytest
import torch
from tiny import random_head

from outrider.decode.engine import SpecEngine
from outrider.decode.draft import Draft
from outrider.decode.proposers.base import Proposer
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.decode.sampling import SamplingParams
from outrider.trees import TreeBudget, static_tree

MAX_NEW = 20
TREES = [TreeBudget(2, 3, 6), TreeBudget(3, 3, 10), TreeBudget(4, 2, 8),
         static_tree("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")]


def _head(model, attention="gqa", draft_vocab=64, seed=0):
    return random_head(model, draft_vocab, seed, attention=attention)


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(5, 90, (n,), generator=g).tolist() for n in (5, 11, 3, 8)]


def _greedy(model, prompts):
    return [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)[0, len(p):]
            .tolist() for p in prompts]


@pytest.fixture(scope="module")
def refs(tiny_models):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _greedy(tiny_models(kind), _prompts())
        return cache[kind]

    return get


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", TREES, ids=lambda t: str(getattr(t, "as_dict", lambda: "static")()))
def test_greedy_tree_decoding_equals_greedy(tiny_kind, tiny_models, refs, attention, batch, tree):
    model = tiny_models(tiny_kind)
    engine = SpecEngine(model, Eagle3Proposer(_head(model, attention), model, tree=tree))
    prompts = _prompts()
    got = []
    for i in range(0, len(prompts), batch):
        got.extend(engine.generate(prompts[i:i + batch], MAX_NEW).tokens)
    assert got == refs(tiny_kind)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_topk_1_tree_is_the_chain(tiny_kind, tiny_models, attention, batch):
    model = tiny_models(tiny_kind)
    head = _head(model, attention)
    prompts = _prompts()[:batch]
    for k in (1, 3, 5):
        chain = SpecEngine(model, Eagle3Proposer(head, model)).generate(prompts, MAX_NEW, k=k)
        tree = SpecEngine(model, Eagle3Proposer(head, model, tree=TreeBudget(1, k, k + 1))).generate(prompts, MAX_NEW)
        assert tree.tokens == chain.tokens
        assert (tree.steps, tree.row_steps, tree.proposed, tree.accepted) == \
            (chain.steps, chain.row_steps, chain.proposed, chain.accepted)


class OracleTree(Proposer):
    """A static tree whose rank-1 branch holds the target's greedy continuation (known in advance)
    and whose rank-0 branch a wrong token: every accepted path runs through a later branch."""

    name = "oracle"
    tree = static_tree("[(0,), (1,), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)]")

    def __init__(self, continuations: list[list[int]], prompts: list[list[int]]):
        self.full = [p + c for p, c in zip(prompts, continuations)]

    def round_shape(self, k):
        return self.tree.nodes, self.tree.steps

    def propose(self, k):
        rows = []
        for b, h in enumerate(self.ctx.histories):
            n = len(h)
            truth = self.full[b][n:n + 3] + [0] * 3  # the next three greedy tokens
            wrong = [(t + 1) % 90 + 5 for t in truth]
            # nodes: (0,) wrong, (1,) truth0, (1,0) wrong1, (1,1) truth1, (1,1,0) wrong2, (1,1,1) truth2
            rows.append([wrong[0], truth[0], wrong[1], truth[1], wrong[2], truth[2]])
        tokens = torch.tensor(rows)
        return Draft(tokens, torch.tensor(self.tree.parents), torch.full((len(rows),), 6), depth=3)


@pytest.mark.parametrize("batch", [1, 4])
def test_an_accepted_later_branch_commits_its_own_slots(tiny_kind, tiny_models, refs, batch):
    model = tiny_models(tiny_kind)
    prompts = _prompts()
    want = refs(tiny_kind)
    got, accepted = [], 0
    for i in range(0, len(prompts), batch):
        r = SpecEngine(model, OracleTree(want[i:i + batch], prompts[i:i + batch])).generate(prompts[i:i + batch],
                                                                                            MAX_NEW)
        got.extend(r.tokens)
        accepted += sum(r.accepted)
        assert r.accept_rate_per_pos[0] == 1.0  # depth 1 is always accepted
    assert got == want
    assert accepted > 0


def test_sampled_tree_decoding_follows_the_target_distribution(tiny_models):
    """Tree sampling and plain sampling give the same token distribution (two-sample TV), as the
    chains' test (tests/test_engine.py) checks it."""
    model = tiny_models("llama")
    rows = 1500
    prompt = _prompts()[1]
    plain = SpecEngine(model, None, sampling=SamplingParams(temperature=1.0, seed=11)).generate([prompt] * rows, 4)
    spec = SpecEngine(model, Eagle3Proposer(_head(model), model, tree=TreeBudget(3, 2, 6)),
                      sampling=SamplingParams(temperature=1.0, seed=90_000)).generate([prompt] * rows, 4)
    V = model.config.vocab_size

    def hist(outs, pos):
        return torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=V).float() / len(outs)

    # reference: the same statistic against another model's samples
    other = SpecEngine(tiny_models("llama", 7), None, sampling=SamplingParams(temperature=1.0, seed=5)
                       ).generate([prompt] * rows, 4)
    for pos in (1, 3):
        tv_same = 0.5 * (hist(plain.tokens, pos) - hist(spec.tokens, pos)).abs().sum().item()
        tv_other = 0.5 * (hist(plain.tokens, pos) - hist(other.tokens, pos)).abs().sum().item()
        assert tv_same < 0.12, tv_same
        assert tv_same < tv_other / 3, (tv_same, tv_other)
