"""Draft-tree specs, torch-free: EAGLE-2 budgets, static trees from paths, their shape, their record keys.

Contract: a draft tree is given as one of two specs, both with the same shape attributes
(``topk``: the most children of a node, the root's included; ``steps``: the depth, one draft
forward per level; ``draft_tokens``: verified per round, root included; ``nodes`` = draft_tokens - 1):
- ``TreeBudget(topk, steps, draft_tokens)``: SGLang's EAGLE-2 budget (``--speculative-eagle-topk``,
  ``--speculative-num-steps``, ``--speculative-num-draft-tokens``), checked at construction:
  2 <= draft_tokens <= 1 + topk + (steps - 1) topk^2 (SGLang's bound), at most ``MAX_DRAFT_TOKENS``,
  and at topk 1 draft_tokens = steps + 1: a chain of k is (1, k, k + 1). ``TreeBudget.parse``
  reads ``TOPK,STEPS,TOKENS``; ``checked`` names the input in its errors.
- ``static_tree(paths)``: vLLM's ``speculative_token_tree`` (a list of paths of child ranks from the
  root, every prefix present, ranks counting up from 0), the one tree-path parser, ordered as vLLM
  orders them (by length, then lexicographic) -> a ``StaticTree`` (paths, parents, ranks). Its shape
  may exceed an EAGLE-2 budget (``budget_of`` checks it when a budget is needed).
- ``shape_of(tree, k)``: (topk, steps, draft_tokens) of a tree, or of the chain of k (None);
  ``sglang_flags(shape)`` those as SGLang's flags, ``shape_label(shape)`` in words.
- Records: ``record_fields(tree)`` the keys a bench record holds for a tree (none for a chain);
  ``tree_of(record, where)`` the tree a record ran (None: a chain); ``budget_of`` its budget.
Bad input is a ``UserError`` naming ``where``.

Not done here: tensors (parent indices, ancestry masks, EAGLE-2 selection: ``ops.tree``),
drafting (``decode.proposers``), pricing (``plan.trees``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Mapping, Union

from outrider.errors import UserError

MAX_DRAFT_TOKENS = 64  # verified tokens per round, root included: the target cache's mask covers 64 new tokens
SGLANG_FLAGS = ("--speculative-eagle-topk", "--speculative-num-steps", "--speculative-num-draft-tokens")
SHAPE_KEYS = ("topk", "steps", "draft_tokens")


def max_draft_tokens(topk: int, steps: int) -> int:
    """Verified tokens (root included) an EAGLE-2 budget can fill: 1 + topk + (steps - 1) topk^2."""
    return 1 + topk + (steps - 1) * topk * topk


def sglang_flags(shape: tuple[int, int, int]) -> str:
    """(topk, steps, draft_tokens) as SGLang's launch flags."""
    return " ".join(f"{f} {v}" for f, v in zip(SGLANG_FLAGS, shape))


def shape_label(shape: tuple[int, int, int]) -> str:
    """(topk, steps, draft_tokens) as ``topk=.. steps=.. draft_tokens=..``."""
    return " ".join(f"{name}={v}" for name, v in zip(SHAPE_KEYS, shape))


def budget_problem(topk: Any, steps: Any, draft_tokens: Any) -> str | None:
    """What makes (topk, steps, draft_tokens) no EAGLE-2 budget, or None."""
    for name, v in zip(SHAPE_KEYS, (topk, steps, draft_tokens)):
        if type(v) is not int:
            return f"'{name}' must be an integer, got {v!r}"
    for name, v in (("topk", topk), ("steps", steps)):
        if v < 1:
            return f"'{name}' must be >= 1, got {v}"
    if draft_tokens < 2:
        return f"draft_tokens {draft_tokens} is impossible: it counts the root and must be >= 2"
    most = max_draft_tokens(topk, steps)
    if draft_tokens > most:
        return (f"draft_tokens {draft_tokens} is impossible for topk {topk}, steps {steps}: {most} is all they can "
                "draft (1 + topk + (steps - 1) * topk^2)")
    if draft_tokens > MAX_DRAFT_TOKENS:
        return f"draft_tokens {draft_tokens} > {MAX_DRAFT_TOKENS}, the most verified per round"
    if topk == 1 and draft_tokens != steps + 1:
        return f"topk 1 is a chain: draft_tokens must be steps + 1 = {steps + 1}, got {draft_tokens}"
    return None


@dataclass(frozen=True, order=True)
class TreeBudget:
    """SGLang's EAGLE-2 budget: ``topk`` children per expanded node, ``steps`` draft forwards (tree
    depth), ``draft_tokens`` verified per round, root included. A chain of k is (1, k, k + 1)."""

    topk: int
    steps: int
    draft_tokens: int

    def __post_init__(self) -> None:
        problem = budget_problem(self.topk, self.steps, self.draft_tokens)
        if problem is not None:
            raise UserError(f"--tree: {problem}")

    @classmethod
    def checked(cls, topk: Any, steps: Any, draft_tokens: Any, where: str) -> "TreeBudget":
        """The budget, or a ``UserError`` naming ``where``."""
        problem = budget_problem(topk, steps, draft_tokens)
        if problem is not None:
            raise UserError(f"{where}: {problem}")
        return cls(topk, steps, draft_tokens)

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

    @property
    def max_draft_tokens(self) -> int:
        """Root + topk at level 1 + topk^2 candidates at each later level (SGLang's bound)."""
        return max_draft_tokens(self.topk, self.steps)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def shape(self) -> tuple[int, int, int]:
        return self.topk, self.steps, self.draft_tokens

    def as_dict(self) -> dict[str, int]:
        return dict(zip(SHAPE_KEYS, self.shape()))

    def label(self) -> str:
        return shape_label(self.shape())


@dataclass(frozen=True)
class StaticTree:
    """A static tree in vLLM's order: ``paths[i]`` is node i's path of child ranks from the root."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]  # [N], -1 = the root
    ranks: tuple[int, ...]  # [N] the node's rank among its parent's children (0 = likeliest)

    @property
    def nodes(self) -> int:
        return len(self.paths)

    @property
    def steps(self) -> int:
        """The depth: one draft forward per level."""
        return max(len(p) for p in self.paths)

    @property
    def topk(self) -> int:
        """The most children of a node, the root's included."""
        return max(self.parents.count(i) for i in range(-1, self.nodes))

    @property
    def draft_tokens(self) -> int:
        return self.nodes + 1

    def shape(self) -> tuple[int, int, int]:
        """(topk, steps, draft_tokens) in SGLang's terms (a static tree fuller than EAGLE-2's
        expansion is not a valid ``TreeBudget``)."""
        return self.topk, self.steps, self.draft_tokens

    def level(self, d: int) -> list[int]:
        """Nodes at depth d (1-based), in order."""
        return [i for i, p in enumerate(self.paths) if len(p) == d]

    def to_text(self) -> str:
        """vLLM's ``speculative_token_tree`` string for this tree."""
        return str([tuple(p) for p in self.paths])


TreeSpec = Union[TreeBudget, StaticTree]


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


def shape_of(tree: TreeSpec | None, k: int) -> tuple[int, int, int]:
    """(topk, steps, draft_tokens) of ``tree``, or of the chain of ``k`` when it is None."""
    return (1, k, k + 1) if tree is None else tree.shape()


def record_fields(tree: TreeSpec | None) -> dict[str, Any]:
    """A tree's keys in a bench record: its shape (a static tree's paths too, as vLLM writes them);
    nothing for a chain."""
    if tree is None:
        return {}
    fields: dict[str, Any] = dict(zip(SHAPE_KEYS, tree.shape()))
    if isinstance(tree, StaticTree):
        fields["tree_paths"] = tree.to_text()
    return fields


def is_tree_record(r: Mapping[str, Any]) -> bool:
    return r.get("topk") is not None or r.get("tree_paths") is not None


def tree_of(r: Mapping[str, Any], where: str) -> TreeSpec | None:
    """The tree a record ran (its ``tree_paths``, else its budget), None for a chain. The shape keys
    beside the paths, and ``verified_tokens`` if present, must agree with it."""
    if not is_tree_record(r):
        return None
    if r.get("tree_paths") is not None:
        tree: TreeSpec = static_tree(r["tree_paths"], f"{where}: 'tree_paths'")
        for name, v in zip(SHAPE_KEYS, tree.shape()):
            if r.get(name) is not None and r.get(name) != v:
                raise UserError(f"{where}: '{name}' {r.get(name)!r} disagrees with its tree_paths "
                                f"({shape_label(tree.shape())})")
    else:
        for name in SHAPE_KEYS:
            v = r.get(name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise UserError(f"{where}: tree record needs an integer '{name}', got {v!r}")
        tree = TreeBudget.checked(r["topk"], r["steps"], r["draft_tokens"], where)
    verified = r.get("verified_tokens")
    if verified is not None and verified != tree.draft_tokens:
        raise UserError(f"{where}: 'verified_tokens' {verified!r} must equal draft_tokens {tree.draft_tokens}")
    return tree


def budget_of(r: Mapping[str, Any], where: str) -> TreeBudget:
    """The checked EAGLE-2 budget of a tree record (a static tree's shape, which must fit one)."""
    tree = tree_of(r, where)
    if tree is None:
        raise UserError(f"{where}: not a tree record (no 'topk' or 'tree_paths')")
    return tree if isinstance(tree, TreeBudget) else TreeBudget.checked(*tree.shape(), where)
