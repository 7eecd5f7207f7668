"""EAGLE-2 draft trees in the planner: tree bench records, a tree round's cost.

Contract:
- The budget (``TreeBudget``) and a record's tree (``budget_of``: ``topk``/``steps``/``draft_tokens``
  or ``tree_paths``) are ``outrider.trees``'s.
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

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

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
from outrider.trees import TreeBudget, budget_of, sglang_flags


def sglang_launch(shape: tuple[int, int, int]) -> str:
    """SGLang's EAGLE-3 flags for (topk, steps, draft_tokens)."""
    return f"--speculative-algorithm EAGLE3 {sglang_flags(shape)}"


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
    measured round of another budget of the same topk prices each later level (``measured_level_s``:
    a level's real cost holds its softmax and top-k over the draft vocabulary and the launches the
    model's weight terms miss); a topk-1 budget is the chain round of k = steps."""
    key = budget.shape()
    measured = draft.measured_tree_round_by_batch.get((key, batch), draft.measured_tree_round_s.get(key))
    if measured is not None:
        return StepCost((Term("draft (measured)", measured, bound="overhead"),), budget.draft_tokens - 1, batch, context)
    if budget.is_chain or draft.shape is None:
        return draft_round_cost(draft, hw, tp, budget.steps, batch, context)
    first = draft_round_cost(draft, hw, tp, 1, batch, context)

    def first_at(b: int) -> float:
        return first.total_s if b == batch else draft_round_cost(draft, hw, tp, 1, b, context).total_s

    level_s = measured_level_s(draft, budget.topk, batch, first_at)
    if level_s is not None:
        return StepCost(first.terms + (Term("draft levels (measured per level)", level_s * (budget.steps - 1),
                                            bound="overhead"),), budget.draft_tokens - 1, batch, context)
    level = step_cost(draft.shape, hw, tp, budget.topk, batch, context, include_step_overhead=False)
    terms = first.terms + level.scaled(budget.steps - 1, prefix="draft ").terms
    return StepCost(terms, budget.draft_tokens - 1, batch, context)


def measured_level_s(draft: DraftSpec, topk: int, batch: int, first_at: Callable[[int], float]) -> float | None:
    """One drafting level of ``topk`` nodes in seconds, from measured rounds of other budgets with the
    same topk and at least two levels: each round less its first step at the round's own batch
    (``first_at(b)``), per later level; the mean over the rounds measured at this batch, else at the
    measured batch nearest to it. None when no round of this topk was measured."""
    rounds = dict(draft.measured_tree_round_by_batch) or {(k, 1): s for k, s in draft.measured_tree_round_s.items()}
    same = [(steps, b, s) for ((t, steps, _), b), s in rounds.items() if t == topk and steps >= 2]
    if not same:
        return None
    nearest = min({b for _, b, _ in same}, key=lambda b: (abs(b - batch), b))
    levels = [(s - first_at(b)) / (steps - 1) for steps, b, s in same if b == nearest]
    return max(sum(levels) / len(levels), 0.0)


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
                      draft_kind="tree", tree=budget.shape(),
                      launch=sglang_launch(budget.shape()))

