"""Draft trees: parent indices, masks, static trees, EAGLE-2 budgets and selection, tree verification."""

from __future__ import annotations

import random

import pytest
import torch

from outrider.decode.verify import verify_greedy
from outrider.decode.verify_tree import verify_tree_greedy, verify_tree_sampling
from outrider.errors import UserError
from outrider.ops.tree import (TreeBudget, ancestors, chain_parents, depths, is_chain, select_nodes, static_tree,
                               verify_mask)

#        root
#       /    \
#      0      1
#     / \     |
#    2   3    4
#    |
#    5
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2])


def test_ancestors_depths_and_mask_of_a_small_tree():
    anc = ancestors(PARENTS)[0]
    assert anc[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert anc[4].nonzero().flatten().tolist() == [1, 4]
    assert depths(PARENTS)[0].tolist() == [1, 1, 2, 2, 2, 3]
    m = verify_mask(PARENTS)[0]  # [7, 7] over root + nodes
    assert m[:, 0].all() and m[0].nonzero().flatten().tolist() == [0]
    assert m[6].nonzero().flatten().tolist() == [0, 1, 3, 6]  # node 5: root, 0, 2, itself


def test_a_chain_is_the_tree_whose_parents_are_i_minus_1():
    p = chain_parents(4)
    assert p.tolist() == [-1, 0, 1, 2] and is_chain(p) and not is_chain(PARENTS)
    assert torch.equal(verify_mask(p)[0], torch.ones(5, 5, dtype=torch.bool).tril())
    assert depths(p)[0].tolist() == [1, 2, 3, 4]


def test_static_tree_follows_vllm_order_and_refuses_non_trees():
    t = static_tree("[(1,), (0, 0), (0,), (0, 1), (1, 0)]")
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert t.parents == (-1, -1, 0, 0, 1) and t.ranks == (0, 1, 0, 1, 0) and t.depth == 2
    assert t.shape() == (2, 2, 6)  # SGLang terms: widest node, depth, nodes + 1
    assert static_tree(t.to_text()) == t
    for bad, says in [("[(0, 0)]", "no parent"), ("[(0,), (0,)]", "twice"), ("[(1,)]", "skips the rank"),
                      ("[]", "non-empty"), ("[(0,), (-1,)]", "not a path"), ("(0,", "not a list"),
                      ("[(0,), 'x']", "not a path")]:
        with pytest.raises(UserError, match=says):
            static_tree(bad)


def test_tree_budget_bounds():
    assert TreeBudget.parse("4, 4, 16").as_dict() == {"topk": 4, "steps": 4, "draft_tokens": 16}
    assert TreeBudget(1, 5, 6).nodes == 5
    TreeBudget(2, 3, 1 + 2 + 2 * 4)  # the most a (2, 3) budget can fill
    for args, says in [((2, 3, 12), "can draft"), ((0, 3, 4), ">= 1"), ((2, 0, 4), ">= 1"), ((2, 3, 1), ">= 2"),
                       ((1, 3, 3), "chain"), ((8, 8, 65), "most verified")]:
        with pytest.raises(UserError, match=says):
            TreeBudget(*args)
    for text in ("4,4", "a,b,c", "4,4,16,1"):
        with pytest.raises(UserError, match="TOPK,STEPS,TOKENS"):
            TreeBudget.parse(text)


def test_select_nodes_keeps_the_best_in_candidate_order_with_their_parents():
    # topk 2, steps 2: level 1 candidates 0, 1; level 2: children of the expanded 0 (2, 3) and 1 (4, 5)
    scores = torch.tensor([[0.6, 0.3, 0.42, 0.12, 0.2, 0.06]])
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    tok, par = select_nodes(scores, tokens, parents, 3)
    assert tok.tolist() == [[10, 11, 12]] and par.tolist() == [[-1, -1, 0]]
    tok, par = select_nodes(scores, tokens, parents, 4)
    assert tok.tolist() == [[10, 11, 12, 14]] and par.tolist() == [[-1, -1, 0, 1]]
    # a tie between a parent and its child keeps the parent (the earlier candidate)
    tok, par = select_nodes(torch.tensor([[0.5, 0.5, 0.5]]), torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 0, 1]]), 2)
    assert tok.tolist() == [[1, 2]] and par.tolist() == [[-1, 0]]


def _logits_with_argmax(best: list[list[int]], vocab: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(best), len(best[0]), vocab, generator=g)
    for b, row in enumerate(best):
        for i, t in enumerate(row):
            logits[b, i, t] = 10.0
    return logits


def test_greedy_tree_verification_takes_the_deepest_correct_path():
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8]])
    # argmax at root, nodes 0..5: root wants 4 (node 1), node 1 wants 7 (node 4), node 4 wants 2 (bonus)
    logits = _logits_with_argmax([[4, 0, 7, 0, 0, 2, 0]])
    v = verify_tree_greedy(tokens, PARENTS, torch.tensor([6]), logits, depth=3)
    assert v.num_accepted.tolist() == [2] and v.tokens[0, :3].tolist() == [4, 7, 2]
    assert v.path.tolist() == [[1, 4, -1]]
    assert v.keep(6).tolist() == [[True, False, True, False, False, True, False]]
    aux = torch.arange(7.0)[None, :, None]  # [1, 7, 1] a value per verified position
    assert v.gather(aux)[0, :, 0].tolist() == [0.0, 2.0, 5.0, 0.0]
    # nothing correct: the argmax at the root alone; node 4 beyond num is never accepted
    logits = _logits_with_argmax([[1, 0, 0, 0, 0, 0, 0]])
    v = verify_tree_greedy(tokens, PARENTS, torch.tensor([6]), logits, depth=3)
    assert v.num_accepted.tolist() == [0] and v.tokens[0, 0].item() == 1 and v.path.tolist() == [[-1, -1, -1]]
    v = verify_tree_greedy(tokens, PARENTS, torch.tensor([4]), _logits_with_argmax([[4, 0, 7, 0, 0, 2, 0]]), depth=3)
    assert v.num_accepted.tolist() == [1] and v.tokens[0, :2].tolist() == [4, 7]


def test_greedy_tree_verification_of_a_chain_equals_chain_verification():
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        B, k, V = 3, 5, 4
        draft = torch.randint(0, V, (B, k), generator=g)
        num = torch.randint(0, k + 1, (B,), generator=g)
        logits = torch.randn(B, k + 1, V, generator=g)
        chain = verify_greedy(draft, num, logits)
        tree = verify_tree_greedy(draft, chain_parents(k), num, logits, depth=k)
        assert torch.equal(chain.num_accepted, tree.num_accepted)
        for b in range(B):
            n = int(chain.num_accepted[b]) + 1
            assert torch.equal(chain.tokens[b, :n], tree.tokens[b, :n])


def test_tree_sampling_follows_the_target_distribution():
    """A two-level tree (two children of the root, one grandchild): point-mass children (top-k) and
    children drawn i.i.d. from q; the first two output tokens follow p (chi-square against the
    exact joint probabilities; a second token the round did not emit is drawn from p, as the next
    round would)."""
    V = 4
    g = torch.Generator().manual_seed(3)
    p_root = torch.tensor([0.1, 0.4, 0.2, 0.3]).double()
    p_next = torch.softmax(torch.randn(V, V, generator=g), -1).double()  # [V, V] p after each first token
    q_root = torch.tensor([0.05, 0.5, 0.05, 0.4]).double()
    q_next = torch.tensor([0.3, 0.3, 0.4, 0.0]).double()
    parents = torch.tensor([-1, -1, 0])
    rng = random.Random(0)
    n = 10000
    for sampled in (False, True):
        counts = torch.zeros(V, V)
        for _ in range(n):
            if sampled:  # children drawn i.i.d. from q (duplicates allowed)
                toks = [int(torch.multinomial(q_root, 1, generator=g)) for _ in range(2)]
                toks.append(int(torch.multinomial(q_next, 1, generator=g)))
                q = torch.stack([q_root, q_root, q_next])[None]
            else:  # the draft's top-2 and top-1: point masses
                toks, q = [1, 3, 2], None
            p = torch.stack([p_root, p_next[toks[0]], p_next[toks[1]], torch.full((V,), 0.25).double()])[None]
            v = verify_tree_sampling(torch.tensor([toks]), parents, torch.tensor([3]), q, p, 2,
                                     lambda b, i: rng.random())
            first = int(v.tokens[0, 0])
            if v.num_accepted[0] == 0:
                second = int(torch.multinomial(p_next[first], 1, generator=g))
            else:
                second = int(v.tokens[0, 1])
            counts[first, second] += 1
        expect = (p_root[:, None] * p_next).float() * n  # [V, V]
        chi2 = float(((counts - expect) ** 2 / expect).sum())
        assert chi2 < 45.0, (sampled, chi2)  # 15 degrees of freedom: p < 1e-4 at 45
