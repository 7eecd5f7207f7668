"""Acceptance: how many tokens a verification step yields, from per-position rates or a scalar.

Contract: with per-position acceptance rates ``a_1..a_k`` of a chain (``a_i`` = P(draft ``i``
accepted | drafts before it accepted)), the expected tokens per step are
``tau = 1 + sum_i prod_{j<=i} a_j`` (the bonus token included); ``alpha`` is the constant-rate
special case (Leviathan et al. 2023, arXiv 2211.17192). ``Acceptance`` holds rates measured at one
k and extrapolates to other k by repeating the last measured rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from outrider.errors import UserError

# --------------------------------------------------------------------------------------------
# Acceptance and expected tokens
# --------------------------------------------------------------------------------------------


def expected_tokens_chain(rates: Sequence[float]) -> float:
    """Tokens per verify step for a chain of len(rates) drafts, bonus token included.

    With a_i the probability that draft i is accepted given drafts 1..i-1 were, draft i survives
    with prod_{j<=i} a_j, so E = 1 + sum_{i=1..k} prod_{j<=i} a_j.
    """
    total, survive = 1.0, 1.0
    for a in rates:
        survive *= a
        total += survive
    return total


def expected_tokens_alpha(alpha: float, k: int) -> float:
    """Leviathan et al. 2023 (arXiv 2211.17192), eq. 1: E = (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def solve_rising(f: Callable[[float], float], target: float, lo: float, hi: float, iterations: int) -> float:
    """The x in [lo, hi] where a rising ``f`` reaches ``target``, by ``iterations`` bisections."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def alpha_from_tau(tau: float, k: int) -> float:
    """The alpha for which ``expected_tokens_alpha(alpha, k) == tau`` (E rises with alpha)."""
    if not 1.0 <= tau < k + 1:
        raise UserError(f"tau {tau} is impossible with k={k} draft tokens: it must be >= 1 and < {k + 1}")
    return solve_rising(lambda a: expected_tokens_alpha(a, k), tau, 0.0, 1.0, 100)


@dataclass(frozen=True)
class Acceptance:
    """Per-position conditional acceptance rates a_1, a_2, ... (the last repeats beyond the list)."""

    rates: tuple[float, ...]
    source: str = ""

    def rates_for(self, k: int) -> tuple[float, ...]:
        if not self.rates:
            return (0.0,) * k
        return tuple(self.rates[i] if i < len(self.rates) else self.rates[-1] for i in range(k))

    def expected_tokens(self, k: int) -> float:
        return expected_tokens_chain(self.rates_for(k))

    @classmethod
    def from_alpha(cls, alpha: float, source: str = "") -> "Acceptance":
        if not 0.0 <= alpha < 1.0:
            raise UserError(f"alpha {alpha} is outside [0, 1): give the per-token acceptance probability")
        return cls((float(alpha),), source or f"alpha={alpha:g}")

    @classmethod
    def from_tau(cls, tau: float, k: int, source: str = "") -> "Acceptance":
        if tau < 1.0:
            raise UserError(f"tau {tau} < 1: tau counts tokens per target forward, bonus token included, so it is >= 1")
        alpha = alpha_from_tau(tau, k)
        return cls((alpha,), source or f"tau={tau:g} at k={k} (alpha={alpha:.3f})")

    @classmethod
    def from_rates(cls, rates: Sequence[float], source: str = "") -> "Acceptance":
        vals = tuple(float(a) for a in rates)
        if any(not 0.0 <= a <= 1.0 for a in vals):
            raise UserError(f"acceptance rates must lie in [0, 1], got {list(vals)}")
        return cls(vals, source)

    @classmethod
    def from_record(cls, record: Mapping[str, Any], origin: str = "bench record") -> "Acceptance":
        """From a bench record: ``accept_rate_per_pos`` (and ``tau`` to tell which kind), or ``tau`` and ``k``.

        Rates may be conditional (a_i = P(draft i accepted | 1..i-1 accepted)) or unconditional
        (u_i = P(at least i drafts accepted)); the one whose expected tokens match the record's
        ``tau`` is taken, conditional when there is no tau. Unconditional rates are converted
        with a_i = u_i / u_{i-1}. Rates per proposed draft (bench's) that give more tokens than the
        measured ``tau`` (steps without a proposal) get a first-position gate so that they give ``tau``.
        """
        method = record.get("method", "?")
        rates = record.get("accept_rate_per_pos")
        tau = record.get("tau")
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float))):
            raise UserError(f"{origin}: 'tau' of method {method} must be a number")
        if rates is None or (isinstance(rates, list) and not rates):
            k = record.get("k")
            if tau is None or not isinstance(k, int) or k < 1:
                raise UserError(f"{origin}: record for method {method} needs 'accept_rate_per_pos' (list) or 'tau' and 'k'")
            return cls.from_tau(float(tau), k, source=f"{origin}: tau={tau:g} at k={k}")
        if not isinstance(rates, list) or any(isinstance(a, bool) or not isinstance(a, (int, float)) for a in rates):
            raise UserError(f"{origin}: 'accept_rate_per_pos' of method {method} must be a list of numbers")
        rates_f = [float(a) for a in rates]
        if any(not 0.0 <= a <= 1.0 for a in rates_f):
            raise UserError(f"{origin}: 'accept_rate_per_pos' of method {method} must lie in [0, 1], got {rates_f}")
        conditional = rates_f
        if tau is not None:
            e_cond = expected_tokens_chain(rates_f)
            e_uncond = 1.0 + sum(rates_f)
            if abs(e_uncond - tau) < abs(e_cond - tau):
                conditional, prev = [], 1.0
                for u in rates_f:
                    conditional.append(min(1.0, u / prev) if prev > 0 else 0.0)
                    prev = u
        if tau is not None and conditional:
            # rates counted per *proposed* draft overstate a proposer that often proposes nothing
            # (n-gram without a match): a first-position gate g = P(a draft is proposed) restores the
            # measured tokens per step, 1 + g * (E - 1)
            e = expected_tokens_chain(conditional)
            if 1.0 <= float(tau) < e - 1e-6:
                conditional[0] *= (float(tau) - 1.0) / (e - 1.0)
        return cls(tuple(conditional), source=f"{origin}: {method} k={record.get('k', len(rates_f))}")
