"""Lossless verification of drafted tokens (Leviathan et al. 2023, arXiv 2211.17192).

Notation: ``p`` is the target distribution, ``q`` the draft's. For a chain of k drafted tokens
``x_1..x_k`` the target forward gives ``p_1..p_{k+1}`` (``p_i`` is the target's distribution
for the position of ``x_i``; ``p_{k+1}`` follows ``x_k``).

- Greedy: ``x_i`` is accepted while it equals ``argmax p_i``; the first mismatch is replaced
  by ``argmax p_i``; if all k match, the bonus token is ``argmax p_{k+1}``. The output is then
  exactly what greedy decoding of the target gives.
- Sampling (Algorithm 1): accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at
  the first rejection sample from ``norm(max(0, p_i - q_i))``; if all are accepted, sample the
  bonus token from ``p_{k+1}``. A draft without probabilities (n-gram) is a point mass:
  ``q_i = onehot(x_i)``. Each output token is then distributed exactly as ``p``.

Output tokens = accepted + one recovered (or bonus) token per row, so every step emits >= 1.
Drafts may be ragged: ``num[b]`` drafted tokens are real in row b; later ones are never accepted.

``verify(draft, logits, ...)`` is the engine's entry: it takes a ``Draft`` and refuses any tree
but a chain. Not done here: trees (the ``Draft`` carries their parent index already), typical
acceptance or any other lossy rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.decode.proposers.base import Draft
from outrider.decode.sampling import RowRandom, SamplingParams, probs, sample


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [batch] long, drafted tokens accepted per row
    tokens: torch.Tensor  # [batch, k+1] long; row b emits tokens[b, :num_accepted[b] + 1]


def _accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """ok: [batch, k] bool -> length of the all-True prefix per row [batch]."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(draft: torch.Tensor, num: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """draft: [batch, k]; num: [batch]; target_logits: [batch, k+1, vocab]."""
    k = draft.shape[1]
    best = target_logits.argmax(dim=-1)  # [batch, k+1]
    real = torch.arange(k, device=draft.device)[None, :] < num[:, None]
    n_acc = _accepted_prefix((draft == best[:, :k]) & real)
    # accepted drafts equal the argmax, and the token after them is the argmax: best is the output
    return VerifyResult(n_acc, best)


def verify_sampling(draft: torch.Tensor, num: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                    u_accept: torch.Tensor, u_sample: torch.Tensor) -> VerifyResult:
    """Rejection sampling.

    draft: [batch, k] drafted tokens; num: [batch] real drafts per row
    q: [batch, k, vocab] draft probabilities, or None for point-mass drafts
    p: [batch, k+1, vocab] processed target probabilities
    u_accept: [batch, k] uniforms for the accept tests; u_sample: [batch] uniforms for the final draw
    """
    B, k = draft.shape
    ar = torch.arange(k, device=draft.device)
    real = ar[None, :] < num[:, None]
    px = p[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    qx = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1) if q is not None else torch.ones_like(px)
    ok = (u_accept.to(px.dtype) * qx < px) & real  # u < p/q without dividing by a zero q
    n_acc = _accepted_prefix(ok)  # [batch]
    rows = torch.arange(B, device=draft.device)
    p_j = p[rows, n_acc]  # [batch, vocab] target distribution at the stop position
    rejected = n_acc < num  # stopped by a rejection rather than running out of drafts
    if q is not None:
        q_j = q[rows, n_acc.clamp_max(k - 1)] if k > 0 else torch.zeros_like(p_j)
    else:
        q_j = torch.zeros_like(p_j)
        if k > 0:
            q_j.scatter_(-1, draft[rows, n_acc.clamp_max(k - 1)].unsqueeze(-1), 1.0)
    residual = (p_j - q_j).clamp_min(0.0)
    empty = residual.sum(-1, keepdim=True) <= 0  # only by rounding: p_j == q_j to float precision
    residual = torch.where(empty, p_j, residual)
    final_dist = torch.where(rejected[:, None], residual, p_j)
    last = sample(final_dist, u_sample)  # [batch]
    tokens = torch.cat([draft, draft.new_zeros(B, 1)], dim=1)
    tokens[rows, n_acc] = last
    return VerifyResult(n_acc, tokens)


def verify(draft: Draft, target_logits: torch.Tensor, sampling: SamplingParams, rand: RowRandom) -> VerifyResult:
    """Verify a chain: greedy, or rejection sampling with ``rand``'s uniforms (k+1 per row).

    target_logits: [batch, k+1, vocab], the target's at the root and at each drafted token.
    """
    if not draft.is_chain():
        raise ValueError("verification takes chains only (parents 0..k-2 after the root)")
    k = draft.tokens.shape[1]
    if sampling.greedy:
        return verify_greedy(draft.tokens, draft.num, target_logits)
    u = rand.uniform(k + 1, target_logits.device)  # [batch, k+1]
    return verify_sampling(draft.tokens, draft.num, draft.q, probs(target_logits, sampling), u[:, :k], u[:, k])
