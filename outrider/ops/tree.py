"""Draft trees as parent indices: ancestry masks, depths, EAGLE-2 node selection.

Contract: a tree of N drafted nodes is a parent index ``[N]`` or ``[batch, N]`` (long; -1 = the
root, the last committed token; every parent precedes its child). A chain of k is the tree whose
parents are ``i - 1``. A node attends to the prefix, the root, its ancestors and itself; its
position is the root's plus its depth (children of the root have depth 1). The same mask serves
the head and the target, GQA and MLA.

- ``ancestors(parents)`` -> bool ``[rows, N, N]`` (rows: 1 for a shared ``[N]`` index, else
  batch): entry (i, j) is True when j is i or an ancestor of i, built by tensor operations alone
  (no loop over nodes, no host value). ``depths(parents)`` -> ``[rows, N]``.
- ``verify_mask(parents)`` (``mask_of(ancestors)``) -> bool ``[rows, 1 + N, 1 + N]`` over the root
  and the nodes.
- ``select_nodes(scores, tokens, parents, n)``: EAGLE-2's last step, as SGLang does it: the n best
  candidates by cumulative draft probability over all levels, kept in candidate order (level by
  level), with their parents renumbered among the kept; a child never outscores its parent, and
  ties keep the earlier candidate, so the kept nodes form a tree.

Not done here: the tree specs (budgets, static paths, their shape: ``outrider.trees``), drafting
(``outrider.decode.proposers``) and verification (``outrider.decode``).
"""

from __future__ import annotations

import torch


def as_rows(parents: torch.Tensor, batch: int) -> torch.Tensor:
    """Parent index ``[N]`` or ``[batch, N]`` -> ``[batch, N]``."""
    return parents.expand(batch, -1) if parents.dim() == 1 else parents


def ancestors(parents: torch.Tensor, depth: int | None = None) -> torch.Tensor:
    """parents: [N] or [batch, N] -> bool [1 or batch, N, N]: (i, j) True when j is i or an ancestor
    of i. The transitive closure of "is the parent of" by repeated squaring: ceil(log2(depth))
    boolean matrix products (``depth``: the greatest depth, default N), no loop over nodes and no
    host value, so a round builds it once on the device (and a CUDA graph can record it)."""
    rows = parents if parents.dim() == 2 else parents[None]
    N = rows.shape[1]
    ar = torch.arange(N, device=rows.device)
    anc = (rows[:, :, None] == ar) | (ar[:, None] == ar)  # [rows, N, N] its parent and itself
    reach = 1  # anc now holds the ancestors up to this many generations up
    while reach + 1 < (N if depth is None else depth):
        anc = torch.bmm(anc.float(), anc.float()) > 0  # paths of up to twice as many generations
        reach *= 2
    return anc


def depths(parents: torch.Tensor) -> torch.Tensor:
    """parents: [N] or [batch, N] -> [1 or batch, N] long, 1 for the root's children."""
    return ancestors(parents).sum(-1)


def chain_parents(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The chain of k as a tree: [k] long, parents i - 1."""
    return torch.arange(-1, k - 1, device=device)


def is_chain(parents: torch.Tensor) -> bool:
    """Is this parent index ([N] or [batch, N]) the chain i - 1 in every row?"""
    want = chain_parents(parents.shape[-1], parents.device)
    return bool((parents == want).all())


def verify_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents: [N] or [batch, N] -> bool [1 or batch, 1 + N, 1 + N]: which of root + nodes each of
    root + nodes may see (the root itself; a node the root, its ancestors and itself)."""
    return mask_of(ancestors(parents))


def mask_of(anc: torch.Tensor) -> torch.Tensor:
    """An ancestry table [rows, N, N] -> the verify mask [rows, 1 + N, 1 + N] over root + nodes."""
    mask = torch.nn.functional.pad(anc, (1, 0, 1, 0), value=False)
    mask[:, :, 0] = True
    return mask


def select_nodes(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's selection of the verified nodes.

    scores: [batch, C] cumulative draft probability of every candidate (level by level)
    tokens: [batch, C] their tokens; parents: [batch, C] candidate index of each one's parent (-1: root)
    n: nodes to keep (draft_tokens - 1) -> (tokens [batch, n], parents [batch, n] among the kept)
    """
    clean = torch.nan_to_num(scores.float(), nan=-1.0)  # a NaN never outranks a real probability
    order = clean.sort(dim=1, descending=True, stable=True).indices[:, :n]  # ties: the earlier candidate
    kept = order.sort(dim=1).values  # [batch, n] candidate order: parents before children
    par = parents.gather(1, kept)  # [batch, n] candidate index of the parent
    pos = torch.searchsorted(kept, par.clamp_min(0))  # [batch, n] its place among the kept
    return tokens.gather(1, kept), torch.where(par >= 0, pos, -1)
