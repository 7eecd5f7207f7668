"""Batches above one: a lockstep batch runs as long as its slowest row; a continuous one does not.

Contract:
- One round of a chain of k drafts emits X tokens for a row, X in 1..k+1, with
  P(X >= j+1) = a_1 ... a_j (``Acceptance``'s conditional per-position rates), so E[X] = tau.
  A row that emits N tokens needs R(N) = min{r : X_1 + ... + X_r >= N} rounds; ``rounds_cdf``
  gives P(R <= r) by convolving X's distribution round by round (tokens capped at N).
- Rows differ (``RowSpread``): each row draws, with its weight, an acceptance multiplier c (its
  rates are min(1, c a_i)) and a reply length N. The multipliers are normalised so that the
  rows' rounds-weighted tau, 1 + accepted / rounds as a bench pools it, is the pooled tau.
- ``RoundsModel.at(batch, mode)``: ``lockstep`` (our engine: all rows advance together until the
  last one ends) runs E[max_i R_i] = sum_{r>=0} 1 - F(r)^B rounds per batch, F the rows' mixture
  CDF (rows drawn independently), and plain decoding E[max_i N_i] steps; ``continuous`` (vLLM,
  SGLang: a finished row's slot is refilled) needs E[N] / tau rounds and E[N] steps per row.
  Either way a batch emits B E[N] tokens, so tokens/s = B E[N] / (rounds x round time): ``batched``
  applies this to a ``cost_model.Prediction``. ``of_rows`` takes given rows instead of drawn ones.

Worked example: tau = 2.26 at k = 3, 64 rows of 128 tokens alike: E[R] = 57 rounds, but the
slowest of 64 rows needs about 64; with the rows as unlike as a measured bench's, about 78.

Not done here: step costs (``cost_model``), requests joining a lockstep batch mid-way, tree drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from outrider.errors import UserError
from outrider.plan import rates as R
from outrider.plan.acceptance import Acceptance, expected_tokens_chain, solve_rising
from outrider.plan.cost_model import Prediction

MODES = ("lockstep", "continuous")


def scaled(rates: Sequence[float], c: float) -> tuple[float, ...]:
    return tuple(min(1.0, max(0.0, c * a)) for a in rates)


def multiplier_for(rates: Sequence[float], tau: float) -> float:
    """The c for which ``expected_tokens_chain(scaled(rates, c)) == tau`` (clipped to what k allows)."""
    if not rates or max(rates) <= 0:
        return 1.0
    return solve_rising(lambda c: expected_tokens_chain(scaled(rates, c)), tau, 0.0,
                        1.0 / min(a for a in rates if a > 0), 60)


def x_pmf(rates: Sequence[float]) -> np.ndarray:
    """P(X = j) for j = 1..k+1: [k+1]."""
    survive = [1.0]
    for a in rates:
        survive.append(survive[-1] * a)
    survive.append(0.0)
    return np.array([survive[j - 1] - survive[j] for j in range(1, len(rates) + 2)])


def rounds_cdf(rates: Sequence[float], tokens: int, tol: float = 1e-12) -> np.ndarray:
    """F[r] = P(R(tokens) <= r), r = 0.. until F reaches 1 - tol (at most ``tokens`` rounds)."""
    if tokens < 1:
        return np.ones(1)
    step = np.concatenate([[0.0], x_pmf(rates)])  # [k+2]: P(X = j) at index j
    live = np.zeros(tokens)  # mass of rows that have emitted i < tokens tokens
    live[0] = 1.0
    cdf = [0.0]
    for _ in range(tokens):
        nxt = np.convolve(live, step)
        live = nxt[:tokens]
        cdf.append(1.0 - float(live.sum()))
        if live.sum() < tol:
            break
    return np.array(cdf)


@dataclass(frozen=True)
class RowProfile:
    multiplier: float  # acceptance multiplier relative to the spread's rates
    tokens: int  # reply length at ``RowSpread.max_new`` new tokens at most
    weight: float = 1.0


@dataclass(frozen=True)
class RowSpread:
    """How the rows of a batch differ: acceptance multipliers and reply lengths, with weights."""

    rows: tuple[RowProfile, ...]
    max_new: int
    source: str

    def lengths_for(self, new_tokens: int) -> list[int]:
        """Each row's reply length when ``new_tokens`` may be generated (lengths scale with the cap)."""
        return [max(1, min(new_tokens, round(p.tokens * new_tokens / self.max_new))) for p in self.rows]


def uniform_spread(new_tokens: int) -> RowSpread:
    return RowSpread((RowProfile(1.0, new_tokens),), new_tokens, "every row alike, every reply at the cap")


def spread_from_bench(rates: Sequence[float], tau_per_row: Sequence[float], steps_per_row: Sequence[int],
                      max_new: int, source: str) -> RowSpread:
    """Rows of a batch-1 bench: row i's multiplier makes the rates give its tau; its length is
    about tau_i x steps_i (the last round's overshoot included), capped at ``max_new``."""
    if len(tau_per_row) != len(steps_per_row) or not tau_per_row:
        raise UserError(f"{source}: per-row tau and steps must be two lists of the same, non-zero length")
    rows = tuple(RowProfile(multiplier_for(rates, t), max(1, min(max_new, round(t * s))))
                 for t, s in zip(tau_per_row, steps_per_row) if s > 0)
    return RowSpread(rows, max_new, source)


def measured_spread() -> RowSpread:
    """The spread of our 30-prompt batch-1 bench (``rates.ROW_SPREAD_*``)."""
    return spread_from_bench(R.ROW_SPREAD_RATES, R.ROW_SPREAD_TAU, R.ROW_SPREAD_STEPS, R.ROW_SPREAD_MAX_NEW,
                             R.ROW_SPREAD_SOURCE)


@dataclass(frozen=True)
class BatchRounds:
    batch: int
    mode: str
    mean_tokens: float  # E[N] per row
    rounds: float  # speculative rounds per batch (lockstep) or per row (continuous)
    ar_steps: float  # plain decoding steps per batch (lockstep) or per row (continuous)
    tau: float  # pooled tau

    @property
    def tokens_per_round(self) -> float:
        """Tokens a row gains per round of its batch: tau for continuous batching, less in lockstep."""
        return self.mean_tokens / self.rounds


class RoundsModel:
    """The rows' round counts for one acceptance and k, ready for any batch size."""

    def __init__(self, acceptance: Acceptance, k: int, spread: RowSpread, new_tokens: int):
        if new_tokens < 1:
            raise UserError(f"new tokens per request must be >= 1, got {new_tokens}")
        rates = acceptance.rates_for(k)
        self.tau = expected_tokens_chain(rates)
        lengths = spread.lengths_for(new_tokens)
        w = np.array([p.weight for p in spread.rows], dtype=float)
        w = w / w.sum()
        mults = [p.multiplier for p in spread.rows]
        s = self._normalise(rates, mults, lengths, w)
        self.row_rates = [scaled(rates, m * s) for m in mults]  # each row's conditional rates, normalised
        cdfs = [rounds_cdf(r, n) for r, n in zip(self.row_rates, lengths)]
        size = max(len(c) for c in cdfs)
        self.row_cdfs = np.stack([np.pad(c, (0, size - len(c)), constant_values=1.0) for c in cdfs])  # [rows, r]
        self.cdf = w @ self.row_cdfs
        self.lengths = lengths
        lens = np.array(lengths)
        self.len_cdf = np.array([float(w[lens <= n].sum()) for n in range(int(lens.max()) + 1)])
        self.mean_tokens = float(np.dot(w, lens))
        self.mean_rounds = float(np.dot(w, [np.sum(1.0 - c) for c in cdfs]))
        self.spread = spread

    def _normalise(self, rates, mults, lengths, w) -> float:
        """s such that the rounds-weighted tau of rows min(1, m s a) equals the pooled tau."""
        if len(mults) == 1 and mults[0] == 1.0:
            return 1.0

        def pooled(s: float) -> float:
            taus = [expected_tokens_chain(scaled(rates, m * s)) for m in mults]
            rounds = [wi * n / t for wi, n, t in zip(w, lengths, taus)]
            return sum(r * t for r, t in zip(rounds, taus)) / sum(rounds)

        return solve_rising(pooled, self.tau, 0.0, 4.0 / max(min(mults), 1e-3), 50)

    def at(self, batch: int, mode: str = "lockstep") -> BatchRounds:
        if mode not in MODES:
            raise UserError(f"unknown batching '{mode}': use one of {', '.join(MODES)}")
        if batch < 1:
            raise UserError(f"batch must be >= 1, got {batch}")
        if mode == "continuous":
            return BatchRounds(batch, mode, self.mean_tokens, self.mean_tokens / self.tau, self.mean_tokens, self.tau)
        rounds = float(np.sum(1.0 - self.cdf ** batch))  # E[max of B] = sum_r P(max > r)
        steps = float(np.sum(1.0 - self.len_cdf ** batch))
        return BatchRounds(batch, mode, self.mean_tokens, rounds, steps, self.tau)


    def of_rows(self, rows: Sequence[int]) -> BatchRounds:
        """One lockstep batch of these rows of the spread (not drawn: exactly these):
        E[max R] = sum_r 1 - prod_i F_i(r), and max_i N_i plain steps."""
        rows = list(rows)
        if not rows:
            raise UserError("a batch needs at least one row")
        rounds = float(np.sum(1.0 - np.prod(self.row_cdfs[rows], axis=0)))
        mean = float(np.mean([self.lengths[i] for i in rows]))
        return BatchRounds(len(rows), "lockstep", mean, rounds, float(max(self.lengths[i] for i in rows)), self.tau)


def batched(pred: Prediction, model: RoundsModel, mode: str) -> Prediction:
    """``pred`` (step costs, pooled tau) under ``mode``: lockstep tokens/s are
    B E[N] / (rounds x (t_verify + t_draft)) against B E[N] / (steps x t_ar); continuous ones keep
    ``cost_model.predict``'s B tau / (t_verify + t_draft) against B / t_ar."""
    if mode == "continuous":
        return replace(pred, batching=mode)
    br = model.at(pred.batch, mode)
    spec = pred.batch * br.mean_tokens / (br.rounds * (pred.verify_step_s + pred.draft_round_s))
    ar = pred.batch * br.mean_tokens / (br.ar_steps * pred.ar_step_s)
    return replace(pred, tokens_per_s=spec, ar_tokens_per_s=ar, speedup=spec / ar, batching=mode,
                   tokens_per_round=br.tokens_per_round)
