"""Lossless verification of a draft, chain or tree: one rule, vectorised over rows and nodes.

Notation (Leviathan et al. 2023, arXiv 2211.17192): ``p`` is the target distribution, ``q`` the
draft's. One target forward over the root (the last committed token) and the N drafted nodes
gives ``p`` at each of them: ``p`` at a node is the target's distribution for its children, so
a node's token is judged by ``p`` at its parent. A chain is the tree whose parents are i - 1, and
then this is Algorithm 1 exactly.

- Greedy: a node is correct when its token is the argmax of ``p`` at its parent; the accepted
  path is the deepest node whose every ancestor is correct (the first such node in index order);
  the bonus token is the argmax of ``p`` at its end. This is exactly greedy decoding.
- Sampling (multi-draft rejection: SpecInfer, arXiv 2305.09781; EAGLE-2, arXiv 2406.16858): at an
  accepted node the residual ``r`` starts as ``p`` there and its children are tried in index
  order: a child x drawn from ``q`` is accepted with ``min(1, r(x) / q(x))``, else
  ``r <- norm(max(r - q, 0))``; a point mass (``q`` None: top-k children, n-gram drafts) is the
  same rule with ``q = onehot(x)``. No child accepted: the output token is drawn from ``r``; the
  path ends at a leaf: the bonus is drawn from ``p`` there. Each output token follows ``p``.
  Vectorised: node i's test reads uniform ``u[:, i]`` (a node is tried at most once), the final
  draw ``u[:, N]``; every node is tested against the residual its parent holds after its earlier
  siblings, one pass per sibling rank (``Draft.siblings``: 1 for a chain), and the accepted path
  is the deepest node whose every ancestor passed.

Output tokens = accepted + one recovered (or bonus) token per row, so every round emits >= 1.
``VerifyResult`` says what to keep: accepted counts, the emitted tokens ``[batch, D + 1]`` (row b
emits its first ``num_accepted[b] + 1``), the accepted nodes by depth (``path``), the cache
positions to keep (``keep``) and a per-position tensor's rows along the path (``gather``). Nothing
here reads a value back to the host.

Not done here: the target forward, committing (``decode.round``), typical acceptance or any other
lossy rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.decode.draft import Draft
from outrider.decode.sampling import RowRandom, SamplingParams, probs, sample


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [batch] long, accepted nodes (the path's depth)
    tokens: torch.Tensor  # [batch, D + 1] long; row b emits tokens[b, :num_accepted[b] + 1]
    path: torch.Tensor  # [batch, D] long: the accepted nodes by depth (entries past num_accepted: -1)

    def keep(self, n_nodes: int) -> torch.Tensor:
        """[batch, 1 + N] bool: the verified positions (root first) the caches keep."""
        B = self.path.shape[0]
        keep = torch.zeros(B, n_nodes + 2, dtype=torch.bool, device=self.path.device)  # the last: a scratch column
        keep.scatter_(1, torch.where(self.path >= 0, self.path + 1, n_nodes + 1), True)
        keep[:, 0] = True
        return keep[:, :n_nodes + 1]

    def end(self) -> torch.Tensor:
        """[batch] the verified position (root 0, node i at i + 1) of each row's accepted path's end."""
        return self.path.amax(1) + 1 if self.path.shape[1] else torch.zeros_like(self.num_accepted)

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """Rows of ``per_position`` [batch, 1 + N, ...] at the root and the path: [batch, D + 1, ...]
        (entries past a row's path repeat its root)."""
        idx = torch.cat([torch.zeros_like(self.path[:, :1]), (self.path + 1).clamp_min(0)], dim=1)  # [batch, D + 1]
        shape = idx.shape + (1,) * (per_position.dim() - 2)
        return per_position.gather(1, idx.reshape(shape).expand(*idx.shape, *per_position.shape[2:]))


def _walk(on: torch.Tensor, anc: torch.Tensor, depths: torch.Tensor, levels: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted path from ``on`` [batch, N] (nodes whose every ancestor, itself included,
    passed) -> (accepted [batch], end node [batch] (-1: the root), path [batch, levels])."""
    B, N = on.shape
    if N == 0:
        none = torch.zeros(B, dtype=torch.long, device=on.device)
        return none, none - 1, none.new_zeros(B, levels)
    score = torch.where(on, depths, 0)  # [batch, N] depth of the nodes on a passed path
    n_acc = score.amax(1)  # [batch]
    end = torch.where(n_acc > 0, score.argmax(1), -1)  # argmax: the first deepest node
    # the path's nodes in index order are in depth order (parents precede children)
    sees = anc.expand(B, N, N).gather(1, end.clamp_min(0)[:, None, None].expand(B, 1, N))[:, 0]  # [batch, N]
    ar = torch.arange(N, device=on.device)
    idx = torch.where(sees, ar, N).sort(dim=1).values[:, :levels]  # [batch, <= levels]
    idx = torch.nn.functional.pad(idx, (0, levels - idx.shape[1]), value=N)
    path = torch.where(torch.arange(levels, device=on.device)[None, :] < n_acc[:, None], idx, -1)
    return n_acc, end, path


def _emit(tokens: torch.Tensor, n_acc: torch.Tensor, path: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[batch, D + 1]: the path's tokens, then ``last`` [batch] (the recovered or bonus token)."""
    out = torch.where(path >= 0, tokens.gather(1, path.clamp_min(0)), 0) if tokens.shape[1] else path
    out = torch.nn.functional.pad(out, (0, 1))
    return out.scatter(1, n_acc[:, None], last[:, None])


def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor, depths: torch.Tensor,
                  num: torch.Tensor, logits: torch.Tensor, levels: int) -> VerifyResult:
    """Greedy acceptance, tensors only (a compiled or captured round calls it directly).

    tokens: [batch, N]; parents: [N] or [batch, N]; anc: [rows, N, N] and depths: [rows, N] (``Draft``);
    num: [batch] real nodes; logits: [batch, 1 + N, vocab] the target's at the root and the nodes.
    """
    B, N = tokens.shape
    best = logits.argmax(-1)  # [batch, 1 + N]
    real = torch.arange(N, device=tokens.device)[None, :] < num[:, None]
    ok = (tokens == best.gather(1, (parents + 1).expand(B, N))) & real  # [batch, N] the argmax at its parent
    on = ~(anc & ~ok[:, None, :]).any(-1)  # [batch, N] it and every ancestor correct
    n_acc, end, path = _walk(on, anc, depths, levels)
    return VerifyResult(n_acc, _emit(tokens, n_acc, path, best.gather(1, (end + 1)[:, None])[:, 0]), path)


def accept_sampled(tokens: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor, depths: torch.Tensor,
                   num: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, u: torch.Tensor, levels: int,
                   siblings: int) -> VerifyResult:
    """Multi-draft rejection sampling, tensors only.

    tokens, parents, anc, depths, num: as ``accept_greedy``; q: [batch, N, vocab] the distribution
    each node was drawn from, or None (point masses); p: [batch, 1 + N, vocab] processed target
    probabilities; u: [batch, N + 1] uniforms; siblings: the most children of one node.
    """
    B, N = tokens.shape
    V = p.shape[-1]
    par = (parents + 1).expand(B, N)  # [batch, N] the parent's verified position (root 0)
    real = torch.arange(N, device=tokens.device)[None, :] < num[:, None]
    earlier = torch.ones(N, N, dtype=torch.bool, device=tokens.device).tril(-1)  # [N, N] j < i
    rank = ((par[:, :, None] == par[:, None, :]) & earlier & real[:, None, :]).sum(-1)  # [batch, N] among siblings
    at_parent = par[:, :, None].expand(B, N, V)
    p_par = p.gather(1, at_parent)  # [batch, N, vocab] p at each node's parent
    res = torch.cat([p, p[:, :1]], dim=1)  # [batch, 1 + N + 1, vocab] residual per position (last: scratch)
    taken = torch.zeros(B, N + 2, dtype=torch.bool, device=p.device)  # a child of this position was accepted
    passed = torch.zeros(B, N, dtype=torch.bool, device=p.device)
    x = tokens[:, :, None]
    qx = q.gather(-1, x)[..., 0] if q is not None else torch.ones(B, N, dtype=p.dtype, device=p.device)
    u_node = u[:, :N].to(p.dtype)
    for m in range(siblings if N else 0):  # the rank-m children of every node at once
        tried = real & (rank == m) & ~taken.gather(1, par)  # [batch, N] earlier siblings all rejected
        r = res.gather(1, at_parent)  # [batch, N, vocab] the parent's residual now
        ok = tried & (u_node * qx < r.gather(-1, x)[..., 0])  # u < r/q without dividing by a zero q
        passed |= ok
        taken.scatter_(1, torch.where(ok, par, N + 1), True)
        rest = (r - q).clamp_min(0.0) if q is not None else r.scatter(-1, x, 0.0)  # [batch, N, vocab]
        total = rest.sum(-1, keepdim=True)
        rest = torch.where(total > 0, rest / total, p_par)  # empty only by rounding: p again
        rejected = torch.where(tried & ~ok, par, N + 1)[:, :, None].expand(B, N, V)
        res.scatter_(1, rejected, rest)  # one rank-m child per parent: no two rows of res collide
    on = ~(anc & ~passed[:, None, :]).any(-1)  # [batch, N] it and every ancestor accepted
    n_acc, end, path = _walk(on, anc, depths, levels)
    # the path's end tried all its children in vain (its residual) or has none (p itself)
    final = res.gather(1, (end + 1)[:, None, None].expand(B, 1, V))[:, 0]  # [batch, vocab]
    return VerifyResult(n_acc, _emit(tokens, n_acc, path, sample(final, u[:, N])), path)


def verify_greedy(draft: Draft, target_logits: torch.Tensor) -> VerifyResult:
    """target_logits: [batch, 1 + N, vocab], the target's at the root and at each node."""
    return accept_greedy(draft.tokens, draft.parents, draft.ancestors, draft.depths, draft.num, target_logits,
                         draft.levels)


def verify_sampling(draft: Draft, p: torch.Tensor, u: torch.Tensor) -> VerifyResult:
    """p: [batch, 1 + N, vocab] processed target probabilities; u: [batch, N + 1] uniforms."""
    return accept_sampled(draft.tokens, draft.parents, draft.ancestors, draft.depths, draft.num, draft.q, p, u,
                          draft.levels, draft.siblings)


def verify(draft: Draft, target_logits: torch.Tensor, sampling: SamplingParams, rand: RowRandom) -> VerifyResult:
    """Verify a draft: greedy, or rejection sampling with ``rand``'s uniforms (N + 1 per row, drawn
    on the host and copied to the device: the one host-to-device transfer of a sampled round).

    target_logits: [batch, 1 + N, vocab], the target's at the root and at each node.
    """
    if sampling.greedy:
        return verify_greedy(draft, target_logits)
    u = rand.uniform(draft.tokens.shape[1] + 1, target_logits.device)  # [batch, N + 1]
    return verify_sampling(draft, probs(target_logits, sampling), u)
