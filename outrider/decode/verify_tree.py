"""Lossless verification of a draft tree (SpecInfer, arXiv 2305.09781; EAGLE-2, arXiv 2406.16858).

Notation as ``outrider.decode.verify``: ``p`` the target distribution, ``q`` the draft's. One
target forward over the root and the N nodes gives ``p`` at each of them (``p`` at a node is the
target's distribution for that node's children).

- Greedy: a node is correct when its token is the argmax of ``p`` at its parent; the accepted
  path is the deepest node whose every ancestor is correct (the first such node in index order),
  and the bonus token is the argmax of ``p`` at its end. This is exactly greedy decoding.
- Sampling (multi-draft rejection, recursive over siblings): at an accepted node the residual
  ``r`` starts as ``p`` there; its children are tried in index order. A child drawn from ``q``
  (``q`` given) is accepted with ``min(1, r(x) / q(x))``, else ``r <- norm(max(r - q, 0))``; a
  child that is a point mass (``q`` None: top-k children) is accepted with ``r(x)``, else
  ``r(x) <- 0`` and ``r`` is renormalised. No child accepted: the output token is drawn from
  ``r``; a leaf accepted: the bonus is drawn from ``p`` at it. Each output token is distributed
  exactly as ``p``.

Outputs are in the chain's shape: accepted node counts, the emitted tokens ``[batch, D + 1]``
(row b emits its first ``num_accepted[b] + 1``), and the accepted path's node indices, which say
which of the verified positions the caches keep.

Not done here: drafting the tree, the target forward, committing the kept slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from outrider.decode.proposers.base import Draft
from outrider.decode.sampling import RowRandom, SamplingParams, probs, sample
from outrider.ops.tree import ancestors, as_rows


@dataclass
class TreeVerdict:
    num_accepted: torch.Tensor  # [batch] long, accepted nodes (the path's depth)
    tokens: torch.Tensor  # [batch, D + 1] long; row b emits tokens[b, :num_accepted[b] + 1]
    path: torch.Tensor  # [batch, D] long: the accepted nodes by depth (entries past num_accepted: -1)

    def keep(self, n_nodes: int) -> torch.Tensor:
        """[batch, 1 + N] bool: the verified positions (root first) the caches keep."""
        B = self.path.shape[0]
        keep = torch.zeros(B, 1 + n_nodes, dtype=torch.bool, device=self.path.device)
        keep[:, 0] = True
        on = self.path >= 0
        keep[torch.arange(B, device=keep.device)[:, None].expand_as(self.path)[on], self.path[on] + 1] = True
        return keep

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """Rows of ``per_position`` [batch, 1 + N, ...] at the root and the path: [batch, D + 1, ...]
        (entries past a row's path repeat its root)."""
        idx = torch.cat([torch.zeros_like(self.path[:, :1]), (self.path + 1).clamp_min(0)], dim=1)  # [batch, D + 1]
        shape = idx.shape + (1,) * (per_position.dim() - 2)
        return per_position.gather(1, idx.reshape(shape).expand(*idx.shape, *per_position.shape[2:]))


def _path(best: torch.Tensor, anc: torch.Tensor, n_acc: torch.Tensor, depth: int) -> torch.Tensor:
    """Nodes of the root path ending at best [batch] (-1: none), ordered by depth -> [batch, depth]."""
    B, N, _ = anc.shape
    rows = torch.arange(B, device=anc.device)
    on = anc[rows, best.clamp_min(0)] & (best >= 0)[:, None]  # [batch, N]: the path's nodes
    # parents precede children: the path's nodes in index order are in depth order
    order = torch.where(on, torch.arange(N, device=anc.device)[None, :], N)  # [batch, N]
    idx = order.sort(dim=1).values[:, :depth]  # [batch, depth]
    if idx.shape[1] < depth:
        idx = torch.cat([idx, idx.new_full((B, depth - idx.shape[1]), N)], dim=1)
    ar = torch.arange(depth, device=anc.device)[None, :]
    return torch.where(ar < n_acc[:, None], idx, -1)


def verify_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, num: torch.Tensor,
                       logits: torch.Tensor, depth: int) -> TreeVerdict:
    """tokens: [batch, N] node tokens; parents: [N] or [batch, N]; num: [batch] real nodes (the
    first num[b]); logits: [batch, 1 + N, vocab] target logits at the root and the nodes; depth:
    the tree's greatest depth."""
    B, N = tokens.shape
    par = as_rows(parents, B)  # [batch, N]
    best_tok = logits.argmax(-1)  # [batch, 1 + N]
    real = torch.arange(N, device=tokens.device)[None, :] < num[:, None]
    ok = (tokens == best_tok.gather(1, par + 1)) & real  # [batch, N] equals the argmax at its parent
    for i in range(N):  # ...and so does every ancestor
        p = par[:, i]
        ok[:, i] &= torch.where(p >= 0, ok.gather(1, p.clamp_min(0)[:, None])[:, 0], True)
    anc = ancestors(par)  # [batch, N, N]
    score = torch.where(ok, anc.sum(-1), 0)  # [batch, N] depth of the correct nodes
    n_acc = score.max(dim=1).values if N else torch.zeros(B, dtype=torch.long, device=tokens.device)
    best = torch.where(n_acc > 0, score.argmax(dim=1), -1)  # argmax: the first deepest node
    path = _path(best, anc, n_acc, depth)  # [batch, depth]
    out = torch.zeros(B, depth + 1, dtype=torch.long, device=tokens.device)
    on = path >= 0
    out[:, :depth] = torch.where(on, tokens.gather(1, path.clamp_min(0)), 0)
    bonus = best_tok.gather(1, (best + 1)[:, None])[:, 0]  # the argmax at the path's end (root: index 0)
    out.scatter_(1, n_acc[:, None], bonus[:, None])
    return TreeVerdict(n_acc, out, path)


def verify_tree_sampling(tokens: torch.Tensor, parents: torch.Tensor, num: torch.Tensor, q: torch.Tensor | None,
                         p: torch.Tensor, depth: int, uniform: Callable[[int, int], float]) -> TreeVerdict:
    """Multi-draft rejection sampling over the tree.

    tokens: [batch, N]; parents: [N] or [batch, N]; num: [batch] real nodes
    q: [batch, N, vocab] the distribution each node was drawn from (its parent's draft
       distribution), or None: every node is a point mass (top-k children)
    p: [batch, 1 + N, vocab] processed target probabilities at the root and the nodes
    uniform(row, i): the row's i-th uniform in [0, 1) for this round (its own stream)
    """
    B, N = tokens.shape
    par = as_rows(parents, B).tolist()
    n_real = num.tolist()
    toks = tokens.tolist()
    out = torch.zeros(B, depth + 1, dtype=torch.long, device=tokens.device)
    path = torch.full((B, depth), -1, dtype=torch.long, device=tokens.device)
    n_acc = torch.zeros(B, dtype=torch.long, device=tokens.device)
    for b in range(B):
        children: dict[int, list[int]] = {}
        for i in range(n_real[b]):
            children.setdefault(par[b][i], []).append(i)
        node, d, draws = -1, 0, 0
        while True:
            r = p[b, node + 1].double()  # [vocab] the residual, first p at the node
            taken = None
            for c in children.get(node, []):
                x = toks[b][c]
                u = uniform(b, draws)
                draws += 1
                if q is None:  # a point mass at x
                    if u < float(r[x]):
                        taken = c
                        break
                    r = r.clone()
                    r[x] = 0.0
                else:
                    qc = q[b, c].double()
                    if u * float(qc[x]) < float(r[x]):
                        taken = c
                        break
                    r = (r - qc).clamp_min(0.0)
                total = float(r.sum())
                r = r / total if total > 0 else p[b, node + 1].double()  # empty only by rounding
            if taken is None:
                out[b, d] = sample(r[None].to(p.dtype), torch.tensor([uniform(b, draws)], dtype=torch.float64))[0]
                break
            path[b, d] = taken
            out[b, d] = toks[b][taken]
            node, d = taken, d + 1
            if d == depth or taken not in children:
                out[b, d] = sample(p[b, node + 1][None], torch.tensor([uniform(b, draws)], dtype=torch.float64))[0]
                break
        n_acc[b] = d
    return TreeVerdict(n_acc, out, path)


def verify_tree(draft: Draft, target_logits: torch.Tensor, sampling: SamplingParams, rand: RowRandom) -> TreeVerdict:
    """Verify a draft tree: greedy, or multi-draft rejection with ``rand``'s uniforms (N + 1 per row).

    target_logits: [batch, 1 + N, vocab], the target's at the root and at each node.
    """
    N = draft.tokens.shape[1]
    parents = draft.parents.to(draft.tokens.device)
    if sampling.greedy:
        return verify_tree_greedy(draft.tokens, parents, draft.num, target_logits, draft.levels)
    u = rand.uniform(N + 1).tolist()  # [batch][N + 1]: a child is tried at most once, then one draw
    return verify_tree_sampling(draft.tokens, parents, draft.num, draft.q, probs(target_logits, sampling),
                                draft.levels, lambda b, i: u[b][i])
