"""EAGLE-2 draft trees in the planner: SGLang's budget, tree bench records, a tree round's cost.

Contract:
- ``TreeBudget(topk, steps, draft_tokens)`` is SGLang's budget (``--speculative-eagle-topk``,
  ``--speculative-num-steps``, ``--speculative-num-draft-tokens``; verified per round, root
  included); ``check`` enforces 2 <= draft_tokens <= 1 + topk + (steps - 1) topk^2 (SGLang's
  bound) and, at topk 1, draft_tokens = steps + 1: a chain of k is (1, k, k + 1).
- ``budget_of(record)`` reads a bench record's tree: ``topk``/``steps``/``draft_tokens``, or
  ``tree_paths`` (vLLM's static tree string: draft_tokens = nodes + 1, steps = depth, topk = the
  most children of any node); ``verified_tokens``, if present, must equal ``draft_tokens``.
- ``tree_entry(record)`` validates a tree record's ``tau`` (required: tokens per target forward,
  bonus included, within [1, min(steps, draft_tokens - 1) + 1]) and ``accept_rate_per_pos``
  (optional: per depth, the fraction of rounds that accepted at least d nodes).
- ``tree_round_cost``: ``steps`` draft forwards, the first as a chain round of one token (fc
  included), each later one over ``topk`` nodes per sequence; ``predict_tree``: that plus ONE
  target forward over ``draft_tokens`` tokens per sequence (a MoE target wakes the experts of
  draft_tokens x batch tokens), and the measured tau as the tokens per round. A topk-1 budget
  costs exactly the chain round of k = steps.

Not done here: choosing a budget or extrapolating tau to budgets nobody measured (only measured
budgets are planned), tree shapes beyond the budget (which nodes SGLang keeps).
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any, Mapping

from outrider.errors import UserError
from outrider.plan.cost_model import (
    DraftSpec,
    ModelShape,
    Prediction,
    StepCost,
    Term,
    draft_round_cost,
    step_cost,
)
from outrider.plan.hardware import HardwareProfile

SGLANG_FLAGS = ("--speculative-eagle-topk", "--speculative-num-steps", "--speculative-num-draft-tokens")


@dataclass(frozen=True, order=True)
class TreeBudget:
    """SGLang's EAGLE-2 budget: ``topk`` children per expanded node, ``steps`` draft forwards (levels),
    ``draft_tokens`` verified per round, root included."""

    topk: int
    steps: int
    draft_tokens: int

    @property
    def max_draft_tokens(self) -> int:
        """Root + topk at level 1 + topk^2 candidates at each later level (SGLang's bound)."""
        return 1 + self.topk + (self.steps - 1) * self.topk ** 2

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def check(self, where: str) -> "TreeBudget":
        for name in ("topk", "steps", "draft_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"{where}: '{name}' must be an integer >= 1, got {v!r}")
        if not 2 <= self.draft_tokens <= self.max_draft_tokens:
            raise UserError(f"{where}: draft_tokens {self.draft_tokens} is impossible for topk {self.topk}, steps "
                            f"{self.steps}: it must lie in [2, 1 + topk + (steps - 1) topk^2 = {self.max_draft_tokens}]")
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise UserError(f"{where}: topk 1 is a chain: draft_tokens must be steps + 1 = {self.steps + 1} (SGLang sets "
                            f"it so), got {self.draft_tokens}")
        return self

    def flags(self) -> str:
        """The budget as SGLang's launch flags."""
        return " ".join(f"{f} {v}" for f, v in zip(SGLANG_FLAGS, (self.topk, self.steps, self.draft_tokens)))

    def label(self) -> str:
        return f"topk={self.topk} steps={self.steps} draft_tokens={self.draft_tokens}"


def chain_budget(k: int) -> TreeBudget:
    """A chain of k drafts in SGLang's terms: (1, k, k + 1)."""
    return TreeBudget(1, k, k + 1)


def sglang_launch(budget: TreeBudget) -> str:
    return f"--speculative-algorithm EAGLE3 {budget.flags()}"


def parse_tree_paths(text: Any, where: str) -> TreeBudget:
    """vLLM's ``speculative_token_tree`` string (paths of child ranks from the root, every prefix
    present) -> the budget it spends: draft_tokens = nodes + 1, steps = depth, topk = most children."""
    try:
        paths = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError):
        raise UserError(f"{where}: 'tree_paths' is not a list of tuples such as \"[(0,), (1,), (0, 0)]\": {text!r}") from None
    if (not isinstance(paths, (list, tuple)) or not paths
            or not all(isinstance(p, (list, tuple)) and p and all(isinstance(c, int) and not isinstance(c, bool)
                                                                   and c >= 0 for c in p) for p in paths)):
        raise UserError(f"{where}: 'tree_paths' must be a non-empty list of paths of child ranks >= 0, got {text!r}")
    nodes = {tuple(p) for p in paths}
    if len(nodes) != len(paths):
        raise UserError(f"{where}: 'tree_paths' repeats a path")
    children: dict[tuple[int, ...], int] = {}
    for p in nodes:
        if len(p) > 1 and p[:-1] not in nodes:
            raise UserError(f"{where}: 'tree_paths' has {p} but not its parent {p[:-1]}: every prefix must be present")
        children[p[:-1]] = max(children.get(p[:-1], 0), p[-1] + 1)
    topk = max(children.values())
    steps = max(len(p) for p in nodes)
    return TreeBudget(topk, steps, len(nodes) + 1)


def _int_field(r: Mapping[str, Any], name: str, where: str) -> int:
    v = r.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise UserError(f"{where}: tree record needs an integer '{name}', got {v!r}")
    return v


def is_tree_record(r: Mapping[str, Any]) -> bool:
    return r.get("topk") is not None or r.get("tree_paths") is not None


def budget_of(r: Mapping[str, Any], where: str) -> TreeBudget:
    """The checked budget of a tree record (``topk``/``steps``/``draft_tokens`` or ``tree_paths``)."""
    if r.get("tree_paths") is not None:
        budget = parse_tree_paths(r["tree_paths"], where)
        for name in ("topk", "steps", "draft_tokens"):
            if r.get(name) is not None and r.get(name) != getattr(budget, name):
                raise UserError(f"{where}: '{name}' {r.get(name)!r} disagrees with its tree_paths ({budget.label()})")
    else:
        topk = _int_field(r, "topk", where)
        if topk < 1:
            raise UserError(f"{where}: 'topk' must be >= 1, got {topk}")
        budget = TreeBudget(topk, _int_field(r, "steps", where), _int_field(r, "draft_tokens", where))
    budget.check(where)
    verified = r.get("verified_tokens")
    if verified is not None and verified != budget.draft_tokens:
        raise UserError(f"{where}: 'verified_tokens' {verified!r} must equal draft_tokens {budget.draft_tokens}")
    return budget


@dataclass(frozen=True)
class TreeEntry:
    """A measured budget: its tau (tokens per target forward, bonus included) and per-depth rates."""

    budget: TreeBudget
    tau: float
    rates: tuple[float, ...]  # depth d = 1..steps: fraction of rounds that accepted >= d nodes
    source: str


def tree_entry(r: Mapping[str, Any], where: str, origin: str) -> TreeEntry:
    budget = budget_of(r, where)
    tau = r.get("tau")
    if tau is None:
        raise UserError(f"{where}: a tree record needs 'tau' (tokens per target forward, bonus included)")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau):
        raise UserError(f"{where}: 'tau' must be a number, got {tau!r}")
    cap = min(budget.steps, budget.draft_tokens - 1) + 1
    if not 1.0 <= tau <= cap + 1e-9:
        raise UserError(f"{where}: tau {tau:g} is impossible: tokens per round lie in [1, {cap}] for "
                        f"{budget.label()}: re-measure with `outrider bench`")
    rates = r.get("accept_rate_per_pos") or []
    if (not isinstance(rates, list) or len(rates) > budget.steps
            or any(isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0 for a in rates)):
        raise UserError(f"{where}: 'accept_rate_per_pos' must list at most steps={budget.steps} fractions in [0, 1] "
                        f"(per depth: rounds that accepted at least d nodes), got {rates!r}")
    return TreeEntry(budget, float(tau), tuple(float(a) for a in rates),
                     f"{origin}: {r.get('method', '?')} tree {budget.label()} tau={float(tau):g}")


# --------------------------------------------------------------------------------------------
# Cost and prediction
# --------------------------------------------------------------------------------------------


def tree_round_cost(draft: DraftSpec, hw: HardwareProfile, tp: int, budget: TreeBudget, batch: int,
                    context: int) -> StepCost:
    """``steps`` draft forwards for each of b sequences: the first over the accepted tokens (a chain
    round of one token, fc included), each later one over ``topk`` nodes per sequence.
    A measured round for this budget (``DraftSpec.measured_tree_round*``) replaces the model; a
    topk-1 budget is the chain round of k = steps."""
    key = (budget.topk, budget.steps, budget.draft_tokens)
    measured = draft.measured_tree_round_by_batch.get((key, batch), draft.measured_tree_round_s.get(key))
    if measured is not None:
        return StepCost((Term("draft (measured)", measured, bound="overhead"),), budget.draft_tokens - 1, batch, context)
    if budget.is_chain or draft.shape is None:
        return draft_round_cost(draft, hw, tp, budget.steps, batch, context)
    first = draft_round_cost(draft, hw, tp, 1, batch, context)
    level = step_cost(draft.shape, hw, tp, budget.topk, batch, context, include_step_overhead=False)
    terms = first.terms + level.scaled(budget.steps - 1, prefix="draft ").terms
    return StepCost(terms, budget.draft_tokens - 1, batch, context)


def predict_tree(shape: ModelShape, hw: HardwareProfile, draft: DraftSpec, budget: TreeBudget, tau: float,
                 batch: int = 1, tp: int = 1, context: int = 2048, method: str = "eagle3-tree") -> Prediction:
    """Speculative tokens/s of one measured budget:

        tokens/s = b * tau / (t_tree_round + t_verify(n = draft_tokens)),  AR tokens/s = b / t_step(n=1)
    """
    ar = step_cost(shape, hw, tp, 1, batch, context)
    verify = step_cost(shape, hw, tp, budget.draft_tokens, batch, context)
    drafting = tree_round_cost(draft, hw, tp, budget, batch, context)
    spec_tps = batch * tau / (verify.total_s + drafting.total_s)
    ar_tps = batch / ar.total_s
    return Prediction(method, budget.draft_tokens - 1, batch, tau, ar.total_s, verify.total_s, drafting.total_s,
                      spec_tps, ar_tps, spec_tps / ar_tps, verify.total_s / ar.total_s, verify, drafting,
                      draft_kind="tree", tree=(budget.topk, budget.steps, budget.draft_tokens),
                      launch=sglang_launch(budget))

