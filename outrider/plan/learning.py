"""Expected acceptance against training tokens: a saturating curve fitted on our heads' runs.

Contract: ``fit_curve(points)`` fits ``tau(N) = tau_inf - a * (N / 1e6) ** -b`` (``a >= 0``) to
(tokens, tau) points by least squares: for each ``b`` on a grid, ``tau_inf`` and ``a`` are linear;
the best ``b`` wins. ``Curve.at(N)`` gives the central value and a range: the spread of the fits
with ``b`` inside the grid's near-optimal set (squared error within ``(1 + 2/dof)`` of the best)
and of the leave-one-record-out fits, widened by twice the residuals' standard deviation. Beyond
the largest fitted N the range is marked as an extrapolation.

Not done here: training, the data's quality (a head trained on more distinct text would move the
level, which these runs cannot separate from the token count)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from outrider.errors import UserError
from outrider.plan.rates import CurvePoint

B_GRID = tuple(round(0.05 * i, 2) for i in range(2, 41))  # 0.10 .. 2.00


@dataclass(frozen=True)
class CurveFit:
    tau_inf: float
    a: float
    b: float
    sse: float

    def at(self, tokens: float) -> float:
        return self.tau_inf - self.a * (tokens / 1e6) ** -self.b


@dataclass(frozen=True)
class Estimate:
    tokens: float
    central: float
    low: float
    high: float
    extrapolated: bool

    def text(self) -> str:
        extra = ", extrapolated beyond the fitted runs" if self.extrapolated else ""
        return f"{self.central:.2f} (range {self.low:.2f}-{self.high:.2f}{extra})"


@dataclass(frozen=True)
class Curve:
    best: CurveFit
    family: tuple[CurveFit, ...]  # the near-optimal and leave-one-out fits
    residual_sd: float
    max_tokens: float
    points: tuple[CurvePoint, ...]

    def at(self, tokens: float) -> Estimate:
        if not tokens > 0:
            raise UserError(f"training tokens must be > 0, got {tokens}")
        values = [f.at(tokens) for f in self.family] + [self.best.at(tokens)]
        lo = max(1.0, min(values) - 2 * self.residual_sd)
        hi = max(values) + 2 * self.residual_sd
        return Estimate(tokens, max(1.0, self.best.at(tokens)), lo, hi, tokens > self.max_tokens * 1.05)

    def formula(self) -> str:
        return (f"tau@5(N) = {self.best.tau_inf:.2f} - {self.best.a:.2f} x (N / 1M tokens)^-{self.best.b:.2f}, "
                f"fitted on {len(self.points)} held-out measurements of our heads (residual sd {self.residual_sd:.2f})")


def _fit_b(x: np.ndarray, y: np.ndarray, b: float) -> CurveFit:
    """Least squares of y = t - a x^-b for fixed b, with a >= 0 (a = 0: a constant)."""
    z = x ** -b
    A = np.stack([np.ones_like(z), -z], axis=1)  # [points, 2]
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    t, a = float(coef[0]), float(coef[1])
    if a < 0:
        t, a = float(y.mean()), 0.0
    sse = float(np.sum((t - a * z - y) ** 2))
    return CurveFit(t, a, b, sse)


def _best(x: np.ndarray, y: np.ndarray) -> tuple[CurveFit, list[CurveFit]]:
    fits = [_fit_b(x, y, b) for b in B_GRID]
    return min(fits, key=lambda f: f.sse), fits


def fit_curve(points: Sequence[CurvePoint]) -> Curve:
    if len(points) < 3:
        raise UserError(f"a learning curve needs at least 3 points, got {len(points)}")
    x = np.array([p.tokens / 1e6 for p in points], dtype=float)
    y = np.array([p.tau for p in points], dtype=float)
    best, fits = _best(x, y)
    dof = max(1, len(points) - 3)
    family = [f for f in fits if f.sse <= best.sse * (1 + 2 / dof) + 1e-12]
    for skip in sorted({p.source.split(" ")[0] for p in points}):  # leave one record out
        keep = [i for i, p in enumerate(points) if p.source.split(" ")[0] != skip]
        if len(keep) >= 3:
            family.append(_best(x[keep], y[keep])[0])
    sd = math.sqrt(best.sse / dof)
    return Curve(best, tuple(family), sd, float(x.max() * 1e6), tuple(points))
