"""Draft trees: parent indices, masks, static trees, EAGLE-2 budgets and selection, tree verification."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from outrider.decode.draft import Draft
from outrider.decode.sampling import sample
from outrider.decode.verify import verify_greedy, verify_sampling
from outrider.errors import UserError
from outrider.ops.tree import ancestors, chain_parents, depths, is_chain, select_nodes, verify_mask
from outrider.trees import TreeBudget, static_tree

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
    assert t.parents == (-1, -1, 0, 0, 1) and t.ranks == (0, 1, 0, 1, 0) and t.steps == 2 and t.nodes == 5
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
    v = verify_greedy(Draft(tokens, PARENTS, torch.tensor([6]), depth=3), logits)
    assert v.num_accepted.tolist() == [2] and v.tokens[0, :3].tolist() == [4, 7, 2]
    assert v.path.tolist() == [[1, 4, -1]]
    assert v.keep(6).tolist() == [[True, False, True, False, False, True, False]]
    aux = torch.arange(7.0)[None, :, None]  # [1, 7, 1] a value per verified position
    assert v.gather(aux)[0, :, 0].tolist() == [0.0, 2.0, 5.0, 0.0]
    # nothing correct: the argmax at the root alone; node 4 beyond num is never accepted
    logits = _logits_with_argmax([[1, 0, 0, 0, 0, 0, 0]])
    v = verify_greedy(Draft(tokens, PARENTS, torch.tensor([6]), depth=3), logits)
    assert v.num_accepted.tolist() == [0] and v.tokens[0, 0].item() == 1 and v.path.tolist() == [[-1, -1, -1]]
    v = verify_greedy(Draft(tokens, PARENTS, torch.tensor([4]), depth=3), _logits_with_argmax([[4, 0, 7, 0, 0, 2, 0]]))
    assert v.num_accepted.tolist() == [1] and v.tokens[0, :2].tolist() == [4, 7]


def _chain_reference(draft: torch.Tensor, num: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """Algorithm 1's greedy rule written out for a chain, row by row: (accepted, emitted tokens)."""
    best = logits.argmax(-1).tolist()
    accepted, emitted = [], []
    for b, row in enumerate(draft.tolist()):
        n = 0
        while n < int(num[b]) and row[n] == best[b][n]:
            n += 1
        accepted.append(n)
        emitted.append(row[:n] + [best[b][n]])
    return accepted, emitted


def test_a_chain_and_the_same_tree_verify_as_algorithm_1():
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        B, k, V = 3, 5, 4
        draft = torch.randint(0, V, (B, k), generator=g)
        num = torch.randint(0, k + 1, (B,), generator=g)
        logits = torch.randn(B, k + 1, V, generator=g)
        accepted, emitted = _chain_reference(draft, num, logits)
        for d in (Draft.chain(draft, num), Draft(draft, chain_parents(k), num), Draft(draft, chain_parents(k)
                                                                                       .expand(B, k), num)):
            v = verify_greedy(d, logits)
            assert v.num_accepted.tolist() == accepted
            assert [v.tokens[b, :accepted[b] + 1].tolist() for b in range(B)] == emitted
            assert v.keep(k).tolist() == [[i <= accepted[b] for i in range(k + 1)] for b in range(B)]


def test_sampled_verification_of_a_chain_is_algorithm_1():
    """Literal cases: accept while u q(x) < p(x); at the first rejection draw from norm(max(p - q, 0));
    all accepted: the bonus from p after the last."""
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])  # [1, k+1, V]
    q = torch.tensor([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])  # [1, k, V]
    d = Draft.chain(torch.tensor([[0, 0]]), torch.tensor([2]), q)
    v = verify_sampling(d, p, torch.tensor([[0.4, 0.0, 0.3]], dtype=torch.float64))
    # x1 = 0 accepted (0.4 * 1 < 0.5); x2 = 0 rejected (p(0) = 0): the residual max(p - q, 0) is token 1
    assert v.num_accepted.tolist() == [1] and v.tokens[0, :2].tolist() == [0, 1] and v.path.tolist() == [[0, -1]]
    v = verify_sampling(d, p, torch.tensor([[0.6, 0.0, 0.3]], dtype=torch.float64))
    # x1 rejected: residual max(p_1 - q_1, 0) = token 1
    assert v.num_accepted.tolist() == [0] and v.tokens[0, 0].item() == 1
    point = Draft.chain(torch.tensor([[1, 1]]), torch.tensor([2]))  # point masses
    v = verify_sampling(point, torch.tensor([[[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]]),
                        torch.tensor([[0.9, 0.9, 0.5]], dtype=torch.float64))
    assert v.num_accepted.tolist() == [2] and v.tokens[0].tolist() == [1, 1, 2]  # the bonus from p_3


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
            u = torch.tensor([[rng.random() for _ in range(4)]], dtype=torch.float64)  # [1, N + 1]
            v = verify_sampling(Draft(torch.tensor([toks]), parents, torch.tensor([3]), q.float() if q is not None
                                      else None, depth=2), p.float(), u)
            first = int(v.tokens[0, 0])
            if v.num_accepted[0] == 0:
                second = int(torch.multinomial(p_next[first], 1, generator=g))
            else:
                second = int(v.tokens[0, 1])
            counts[first, second] += 1
        expect = (p_root[:, None] * p_next).float() * n  # [V, V]
        chi2 = float(((counts - expect) ** 2 / expect).sum())
        assert chi2 < 45.0, (sampled, chi2)  # 15 degrees of freedom: p < 1e-4 at 45


def _random_trees(g: torch.Generator, B: int, N: int) -> torch.Tensor:
    """[B, N] parent indices: node i's parent drawn from the root and the nodes before it."""
    return torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(N)])
                        for _ in range(B)])


def _greedy_reference(tokens, parents, num, logits):
    """Greedy: the deepest node (first in index order) whose path's every token is the argmax at its
    parent, node by node: (accepted, emitted tokens)."""
    best = logits.argmax(-1).tolist()
    depth, path = {-1: 0}, {-1: []}
    for i in range(int(num)):
        par = int(parents[i])
        if par in depth and int(tokens[i]) == best[par + 1]:
            depth[i], path[i] = depth[par] + 1, path[par] + [int(tokens[i])]
    end = max(depth, key=lambda i: (depth[i], -i))
    return depth[end], path[end] + [best[end + 1]]


def _walk_reference(tokens, parents, num, p, q, u):
    """Sampled: the recursive rejection walked node by node, one row at a time (the DESIGN's
    contract, node i's test on u[i], the final draw on u[N]): (accepted, emitted tokens)."""
    N = tokens.shape[0]
    children = {}
    for i in range(int(num)):
        children.setdefault(int(parents[i]), []).append(i)
    node, out = -1, []
    while True:
        r = p[node + 1].clone()
        taken = None
        for c in children.get(node, []):
            x = int(tokens[c])
            qc = q[c] if q is not None else torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).to(p.dtype)
            if float(u[c]) * float(qc[x]) < float(r[x]):
                taken = c
                break
            r = (r - qc).clamp_min(0.0)
            r = r / r.sum() if float(r.sum()) > 0 else p[node + 1].clone()
        if taken is None:
            return len(out), out + [int(sample(r, u[N]))]
        out.append(int(tokens[taken]))
        node = taken


def test_vectorised_verification_equals_the_walk_node_by_node():
    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        B, N, V = 3, 7, 5
        parents = _random_trees(g, B, N)
        tokens = torch.randint(0, V, (B, N), generator=g)
        num = torch.randint(0, N + 1, (B,), generator=g)
        logits = torch.randn(B, N + 1, V, generator=g, dtype=torch.float64) * 2
        p = torch.softmax(logits, -1)
        q = torch.softmax(torch.randn(B, N, V, generator=g, dtype=torch.float64), -1) if trial % 2 else None
        u = torch.rand(B, N + 1, generator=g, dtype=torch.float64)
        d = Draft(tokens, parents, num, q)
        for greedy, v in ((True, verify_greedy(d, logits)), (False, verify_sampling(d, p, u))):
            for b in range(B):
                n, emitted = (_greedy_reference(tokens[b], parents[b], num[b], logits[b]) if greedy else
                              _walk_reference(tokens[b], parents[b], num[b], p[b], None if q is None else q[b], u[b]))
                assert int(v.num_accepted[b]) == n and v.tokens[b, :n + 1].tolist() == emitted, (trial, greedy, b)
                assert [int(tokens[b, i]) for i in v.path[b, :n].tolist()] == emitted[:n]


def test_verification_reads_nothing_back_to_the_host(monkeypatch):
    """The ancestry of trees chosen per row and their verification, greedy and sampled, are tensor
    operations alone: no .item(), .tolist(), bool(), int() or float() of a tensor inside a round."""
    g = torch.Generator().manual_seed(2)
    B, N, V = 3, 6, 7
    tokens = torch.randint(0, V, (B, N), generator=g)
    parents = torch.stack([PARENTS, chain_parents(N), torch.tensor([-1, 0, 1, -1, 3, 0])])
    logits = torch.randn(B, N + 1, V, generator=g)
    p, q = torch.softmax(logits, -1), torch.softmax(torch.randn(B, N, V, generator=g), -1)
    u = torch.rand(B, N + 1, generator=g, dtype=torch.float64)
    num = torch.tensor([6, 5, 6])

    def refuse(*args, **kwargs):
        raise AssertionError("a host read inside a round")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
            m.setattr(torch.Tensor, name, refuse)
        d = Draft(tokens, parents, num, depth=N, width=2)  # row 1 is the chain of N
        got = [verify_greedy(d, logits), verify_sampling(d, p, u), verify_sampling(replace(d, q=q), p, u)]
        mask, offsets = d.verify_mask(), d.offsets()
    assert mask.shape == (B, N + 1, N + 1) and offsets[1].tolist() == list(range(N + 1))
    for b in range(B):  # each row as its own batch of one: the same outcome
        one = Draft(tokens[b:b + 1], parents[b], num[b:b + 1], depth=N)
        for v, w in zip(got, [verify_greedy(one, logits[b:b + 1]), verify_sampling(one, p[b:b + 1], u[b:b + 1]),
                              verify_sampling(replace(one, q=q[b:b + 1]), p[b:b + 1], u[b:b + 1])]):
            assert torch.equal(v.num_accepted[b:b + 1], w.num_accepted) and torch.equal(v.tokens[b:b + 1], w.tokens)


def test_one_spec_shape_and_record_round_trip():
    from outrider.trees import record_fields, shape_of, tree_of

    budget, paths = TreeBudget(4, 3, 10), static_tree("[(0,), (1,), (0, 0), (1, 0)]")
    assert shape_of(None, 5) == (1, 5, 6) and shape_of(budget, 5) == (4, 3, 10) and shape_of(paths, 5) == (2, 2, 5)
    assert (paths.nodes, paths.steps, paths.topk, paths.draft_tokens) == (4, 2, 2, 5)
    for tree in (budget, paths):
        assert tree_of({"method": "eagle3", **record_fields(tree)}, "r") == tree
    assert record_fields(None) == {} and tree_of({"method": "eagle3", "k": 3}, "r") is None
    with pytest.raises(UserError, match="disagrees with its tree_paths"):
        tree_of({**record_fields(paths), "steps": 3}, "r")
