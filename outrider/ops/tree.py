"""Draft trees as parent indices: ancestry masks, depths, static trees from paths, EAGLE-2 budgets.

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
- ``static_tree(paths)``: vLLM's ``speculative_token_tree`` (paths of child ranks from the root,
  every prefix present), ordered as vLLM orders them (by length, then lexicographic) -> a
  ``StaticTree`` (parents, child ranks, depth); anything else is a ``UserError``.
- ``TreeBudget(topk, steps, draft_tokens)``: SGLang's EAGLE-2 budget, checked at construction.
- ``select_nodes(scores, tokens, parents, n)``: EAGLE-2's last step, as SGLang does it: the n best
  candidates by cumulative draft probability over all levels, kept in candidate order (level by
  level), with their parents renumbered among the kept; a child never outscores its parent, and
  ties keep the earlier candidate, so the kept nodes form a tree.

Not done here: drafting (``outrider.decode.proposers``) and verification (``outrider.decode``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import torch

from outrider.errors import UserError

MAX_DRAFT_TOKENS = 64  # verified tokens per round, root included: the target cache's mask covers 64 new tokens


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


@dataclass(frozen=True)
class StaticTree:
    """A static tree in vLLM's order: ``paths[i]`` is node i's path of child ranks from the root."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]  # [N], -1 = the root
    ranks: tuple[int, ...]  # [N] the node's rank among its parent's children (0 = likeliest)

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def shape(self) -> tuple[int, int, int]:
        """(topk, steps, draft_tokens) in SGLang's terms: the most children of a node (the root's
        included), the depth, the nodes + 1 (a static tree fuller than EAGLE-2's expansion is not a
        valid ``TreeBudget``)."""
        return max(self.parents.count(i) for i in range(-1, self.size)), self.depth, self.size + 1

    def level(self, d: int) -> list[int]:
        """Nodes at depth d (1-based), in order."""
        return [i for i, p in enumerate(self.paths) if len(p) == d]

    def to_text(self) -> str:
        """vLLM's ``speculative_token_tree`` string for this tree."""
        return str([tuple(p) for p in self.paths])


def static_tree(paths: object, where: str = "the tree") -> StaticTree:
    """vLLM's token-tree syntax (a list of tuples of child ranks, or its text) -> a ``StaticTree``."""
    if isinstance(paths, str):
        try:
            paths = ast.literal_eval(paths.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise UserError(f"{where}: not a list of paths of child ranks such as [(0,), (0, 0), (1,)]") from None
    if not isinstance(paths, (list, tuple)) or not paths:
        raise UserError(f"{where}: a tree is a non-empty list of paths such as [(0,), (0, 0), (1,)]")
    seen = set()
    for p in paths:
        if not isinstance(p, (list, tuple)) or not p or not all(type(r) is int and r >= 0 for r in p):
            raise UserError(f"{where}: {p!r} is not a path (a non-empty tuple of child ranks >= 0)")
        t = tuple(p)
        if t in seen:
            raise UserError(f"{where}: the path {t} appears twice")
        seen.add(t)
    ordered = sorted(seen, key=lambda t: (len(t), t))  # vLLM's order: by length, then lexicographic
    for t in ordered:
        if len(t) > 1 and t[:-1] not in seen:
            raise UserError(f"{where}: the path {t} has no parent {t[:-1]} (every prefix must be present)")
        if t[-1] > 0 and t[:-1] + (t[-1] - 1,) not in seen:
            raise UserError(f"{where}: the path {t} skips the rank {t[-1] - 1} (child ranks count up from 0)")
    if len(ordered) + 1 > MAX_DRAFT_TOKENS:
        raise UserError(f"{where}: {len(ordered)} nodes; at most {MAX_DRAFT_TOKENS - 1} are verified per round")
    index = {t: i for i, t in enumerate(ordered)}
    parents = tuple(index[t[:-1]] if len(t) > 1 else -1 for t in ordered)
    return StaticTree(tuple(ordered), parents, tuple(t[-1] for t in ordered))


def max_draft_tokens(topk: int, steps: int) -> int:
    """Verified tokens (root included) an EAGLE-2 budget can fill: 1 + topk + (steps - 1) topk^2."""
    return 1 + topk + (steps - 1) * topk * topk


@dataclass(frozen=True)
class TreeBudget:
    """SGLang's EAGLE-2 budget: ``topk`` children per expanded node, ``steps`` draft forwards (tree
    depth), ``draft_tokens`` verified per round, root included. A chain of k is (1, k, k + 1)."""

    topk: int
    steps: int
    draft_tokens: int

    def __post_init__(self) -> None:
        for name in ("topk", "steps", "draft_tokens"):
            if type(getattr(self, name)) is not int:
                raise UserError(f"--tree: {name} must be an integer, got {getattr(self, name)!r}")
        if self.topk < 1 or self.steps < 1:
            raise UserError(f"--tree: topk and steps must be >= 1, got topk {self.topk}, steps {self.steps}")
        if self.draft_tokens < 2:
            raise UserError(f"--tree: draft_tokens counts the root and must be >= 2, got {self.draft_tokens}")
        most = max_draft_tokens(self.topk, self.steps)
        if self.draft_tokens > most:
            raise UserError(f"--tree: draft_tokens {self.draft_tokens} > {most}, all that topk {self.topk} and "
                            f"steps {self.steps} can draft (1 + topk + (steps - 1) * topk^2)")
        if self.draft_tokens > MAX_DRAFT_TOKENS:
            raise UserError(f"--tree: draft_tokens {self.draft_tokens} > {MAX_DRAFT_TOKENS}, the most verified "
                            "per round")
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise UserError(f"--tree: with topk 1 the tree is a chain: draft_tokens must be steps + 1 = "
                            f"{self.steps + 1}, got {self.draft_tokens}")

    @classmethod
    def parse(cls, text: str) -> "TreeBudget":
        """``TOPK,STEPS,TOKENS`` -> a checked budget."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) != 3 or not all(p.lstrip("-").isdigit() for p in parts):
            raise UserError(f"--tree: expected TOPK,STEPS,TOKENS (three integers, e.g. 4,4,16), got {text!r}")
        return cls(*(int(p) for p in parts))

    @property
    def nodes(self) -> int:
        return self.draft_tokens - 1

    def as_dict(self) -> dict[str, int]:
        return {"topk": self.topk, "steps": self.steps, "draft_tokens": self.draft_tokens}


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
