"""Fitting the cost model to measurements: step times from ``bench`` records, or a single-stream
decode rate measured on the user's cluster.

Contract: ``calibrate(records, shape, hw)`` fits the per-forward overheads (and, where the records
allow, the memory efficiency) so that predicted AR, verify and draft step times match the measured
ones, and reports the remaining relative error per record; ``calibrate_measured`` fits the same to
one decode rate. A ``Calibration`` applies to a ``HardwareProfile`` (``apply``). Records that lack
step times are ``UserError`` with the field that is missing. Tree records (``topk``/``steps``/
``draft_tokens`` or ``tree_paths``, ``trees.budget_of``) count as chain records do: their
``verify_step_ms`` is one target forward over ``draft_tokens`` tokens, their ``draft_step_ms`` a
round of ``steps`` draft forwards, kept per budget (``tree_round_s``); topk 1 is the chain k = steps.

Not done here: measuring (``outrider bench``), predicting (``cost_model``, ``planner``)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np

from outrider.errors import UserError
from outrider.plan.cost_model import ModelShape, allreduce_s, step_cost
from outrider.plan.hardware import ACT_BYTES, HardwareProfile
from outrider.records import records_of
from outrider.trees import budget_of

# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Efficiency and overhead terms fitted to measured step times, and the fit's residuals."""

    memory_efficiency: float
    compute_efficiency: float
    step_overhead_s: float
    layer_overhead_s: float
    link_latency_s: float | None = None
    collectives_per_layer: float | None = None
    draft_round_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)  # method -> k -> s
    draft_round_by_batch: Mapping[str, Mapping[tuple[int, int], float]] = field(default_factory=dict)  # (k, batch)
    tree_round_s: Mapping[str, Mapping[tuple[int, int, int], float]] = field(default_factory=dict)  # method -> budget
    tree_round_by_batch: Mapping[str, Mapping[tuple[tuple[int, int, int], int], float]] = field(default_factory=dict)
    token_overhead_s: float = 0.0
    verify_overhead_s: float = 0.0
    points: tuple[tuple[int, int, float, float], ...] = ()  # (new_tokens, batch, measured_s, fitted_s)
    source: str = ""

    @property
    def max_relative_error(self) -> float:
        return max((abs(f - m) / m for _, _, m, f in self.points), default=0.0)

    def apply(self, hw: HardwareProfile) -> HardwareProfile:
        changes: dict[str, Any] = dict(memory_efficiency=self.memory_efficiency, compute_efficiency=self.compute_efficiency,
                                       step_overhead_s=self.step_overhead_s, layer_overhead_s=self.layer_overhead_s,
                                       token_overhead_s=self.token_overhead_s,
                                       verify_overhead_s=self.verify_overhead_s)
        if self.link_latency_s is not None:
            changes["link_latency_s"] = self.link_latency_s
        if self.collectives_per_layer is not None:
            changes["collectives_per_layer"] = self.collectives_per_layer
        return replace(hw, **changes)

    def summary(self) -> str:
        text = (f"calibrated ({self.source}): memory efficiency {self.memory_efficiency:.2f}, compute efficiency "
                f"{self.compute_efficiency:.2f}, overhead {self.step_overhead_s * 1e3:.3f} ms/step + "
                f"{self.layer_overhead_s * 1e6:.1f} us/layer + {self.token_overhead_s * 1e6:.1f} us/token + "
                f"{self.verify_overhead_s * 1e3:.3f} ms/verification")
        if self.points:
            text += f"; worst step-time residual {self.max_relative_error:.1%} over {len(self.points)} points"
        return text


def _ms(value: Any, what: str, origin: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{origin}: '{what}' must be a positive number of milliseconds, got {value!r}")
    return float(value) / 1e3


def _by_k(value: Any, record: Mapping[str, Any], what: str, origin: str) -> dict[int, float]:
    """A per-k table of seconds from ``{k: ms}`` or a number for the record's own ``k``."""
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            try:
                kk = int(key)
            except (TypeError, ValueError):
                raise UserError(f"{origin}: keys of '{what}' must be integers k, got {key!r}") from None
            out[kk] = _ms(v, f"{what}[{key}]", origin)
        return out
    k = record.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UserError(f"{origin}: '{what}' is a single number but the record has no integer 'k' >= 1; give {{k: ms}}")
    return {k: _ms(value, what, origin)}


def _parse_timing_records(data: Any, context: int, origin: str):
    records = records_of(data, origin)
    points: list[tuple[int, int, int, float]] = []  # (n, b, c, seconds)
    drafts: dict[str, dict[int, float]] = {}
    by_batch: dict[str, dict[tuple[int, int], float]] = {}
    trees: dict[str, dict[tuple[int, int, int], float]] = {}
    trees_by_batch: dict[str, dict[tuple[tuple[int, int, int], int], float]] = {}
    def batch_of(r: Mapping[str, Any]) -> int:
        b = r.get("batch", r.get("batch_size", 1))
        return b if isinstance(b, int) and not isinstance(b, bool) else 1

    for r in sorted(records, key=lambda r: -batch_of(r)):  # largest batch first: per k, the smallest wins
        b = r.get("batch", r.get("batch_size", 1))
        c = r.get("context", context)
        if not isinstance(b, int) or b < 1 or not isinstance(c, int) or c < 0:
            raise UserError(f"{origin}: 'batch' and 'context' must be integers (batch >= 1, context >= 0)")
        plain = r.method == "ar" or r.k == 0  # an autoregressive record: its steps are n=1
        if r.tree is not None and not plain:
            budget = budget_of(r, f"{origin}: {r.method} tree record")
            if budget.is_chain:
                r = {**r, "k": budget.steps}  # topk 1: the chain of k = steps
            else:
                key = budget.shape()
                if r.get("ar_step_ms") is not None:
                    points.append((1, b, c, _ms(r["ar_step_ms"], "ar_step_ms", origin)))
                if r.get("verify_step_ms") is not None:
                    points.append((budget.draft_tokens, b, c, _ms(r["verify_step_ms"], "verify_step_ms", origin)))
                draft_ms = r.get("draft_step_ms", r.get("propose_step_ms"))
                if draft_ms is not None and r.get("method"):
                    s = _ms(draft_ms, "draft_step_ms", origin)
                    trees.setdefault(str(r["method"]), {})[key] = s
                    trees_by_batch.setdefault(str(r["method"]), {})[(key, b)] = s
                continue
        if r.get("ar_step_ms") is not None:
            points.append((1, b, c, _ms(r["ar_step_ms"], "ar_step_ms", origin)))
        if r.get("verify_step_ms") is not None:
            if plain and not isinstance(r["verify_step_ms"], dict):
                points.append((1, b, c, _ms(r["verify_step_ms"], "verify_step_ms", origin)))
            else:
                for k, s in _by_k(r["verify_step_ms"], r, "verify_step_ms", origin).items():
                    points.append((k + 1, b, c, s))
        if r.get("verify_step_ms_by_n") is not None:
            for n, s in _by_k(r["verify_step_ms_by_n"], {}, "verify_step_ms_by_n", origin).items():
                points.append((n, b, c, s))
        draft_ms = r.get("draft_step_ms", r.get("propose_step_ms"))
        if draft_ms is not None and r.get("method") and not plain:
            per_k = _by_k(draft_ms, r, "draft_step_ms", origin)
            drafts.setdefault(str(r["method"]), {}).update(per_k)
            by_batch.setdefault(str(r["method"]), {}).update({(k, b): s for k, s in per_k.items()})
    has_ar = any(n == 1 for n, *_ in points)
    has_verify = any(n > 1 for n, *_ in points)
    if not (has_ar and has_verify):
        raise UserError(f"{origin}: calibration needs measured step times: 'ar_step_ms' and 'verify_step_ms' "
                        f"(a number for the record's k, or {{k: ms}}) in the bench records; run `outrider bench` "
                        f"with --json to record them")
    # average repeated measurements of the same (n, b, c)
    merged: dict[tuple[int, int, int], list[float]] = {}
    for n, b, c, s in points:
        merged.setdefault((n, b, c), []).append(s)
    return ([(n, b, c, sum(v) / len(v)) for (n, b, c), v in sorted(merged.items())], drafts, by_batch,
            (trees, trees_by_batch))


def _split_overhead(total_s: float, shape: ModelShape, hw: HardwareProfile) -> tuple[float, float]:
    """Split a fitted per-step overhead into the profile's per-step part and a per-layer rest."""
    step = min(hw.step_overhead_s, total_s)
    return step, (total_s - step) / (shape.num_layers + 1)


def _fit_overheads(resid: list[float], regressors: list[list[float]], weights: list[float]) -> list[float]:
    """Weighted least squares of ``resid ~ sum_j c_j * x_j`` with every ``c_j >= 0``.

    regressors: per point, the values of the terms (e.g. 1, new tokens, is-verification). Tries
    every subset of the terms (there are at most three), fits it by its normal equations, keeps
    the non-negative fits and returns the best one's coefficients (0 for terms left out).
    """
    x = np.asarray(regressors, dtype=float)  # [points, terms]
    y = np.asarray(resid, dtype=float)
    sw = np.sqrt(np.asarray(weights, dtype=float))
    best, best_loss = [0.0] * x.shape[1], float(np.sum((sw * y) ** 2))
    for r in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), r):
            a = x[:, cols] * sw[:, None]
            coef, *_ = np.linalg.lstsq(a, sw * y, rcond=None)
            if np.any(coef < 0):
                continue
            loss = float(np.sum((a @ coef - sw * y) ** 2))
            if loss < best_loss * (1 - 1e-12):
                best_loss, best = loss, [0.0] * x.shape[1]
                for c, v in zip(cols, coef):
                    best[c] = float(v)
    return best


def calibrate(bench_records: list[Mapping[str, Any]], shape: ModelShape, hw: HardwareProfile, tp: int = 1,
              context: int = 2048, origin: str = "bench records") -> Calibration:
    """Fit memory/compute efficiency and the fixed overhead to measured step times.

    Inputs are *step times only*: ``ar_step_ms`` (one token per sequence) and ``verify_step_ms``
    (k+1 tokens; ``{k: ms}`` or a number with the record's ``k``; ``verify_step_ms_by_n`` keys by
    n instead; in an ``ar`` / k=0 record it is a one-token step), at the record's ``batch``
    (or ``batch_size``, default 1) and ``context`` (default ``context``). ``draft_step_ms`` (or
    ``propose_step_ms``: one round of k proposals) is kept as measured and used for that method, at
    the record's batch size (other batch sizes take the smallest measured batch's). A tree record's
    ``verify_step_ms`` is a number: one forward over its ``draft_tokens``; its draft round (``steps``
    forwards) is kept per budget.
    Measured speedups are never read.

    Fit: for each (eta_mem, eta_cmp) on a log grid, the residual is fitted as a fixed overhead O,
    plus a per-token overhead T times the step's new tokens (where the points hold more than one
    token count), plus a per-verification overhead V on steps of n > 1 (where plain steps and
    several verification widths were measured): weighted least squares on relative error, every
    term >= 0; the pair minimising the squared relative error wins, ties going to the higher
    efficiencies. The AllReduce term keeps the profile's link latency and bandwidth (give
    ``allreduce_share`` through ``calibrate_measured`` to fit it).
    """
    points, drafts, by_batch, (trees, trees_by_batch) = _parse_timing_records(bench_records, context, origin)
    base = replace(hw, memory_efficiency=1.0, compute_efficiency=1.0, step_overhead_s=0.0, layer_overhead_s=0.0,
                   token_overhead_s=0.0)
    # per point: (memory seconds at eff 1, compute seconds at eff 1) per term, and fixed seconds
    prepared = []
    for n, b, c, measured in points:
        cost = step_cost(shape, base, tp, n, b, c)
        parts = []
        fixed = 0.0
        for t in cost.terms:
            if t.bound in ("memory", "compute"):
                parts.append((t.bytes / base.memory_ceiling_bytes_per_s, t.flops / base.flops_ceiling_per_s(t.compute)))
            else:
                fixed += t.time_s
        prepared.append((parts, fixed, measured, n * b))
    grid = [10 ** (-2 + 2 * i / 60) for i in range(60, -1, -1)]  # 1.0 down to 0.01
    weights = [1.0 / (y * y) for _, _, y, _ in prepared]
    # overhead terms: fixed per step; per new token (when the points hold several token counts);
    # per verification (when there are plain steps to set it against)
    tokens = [m for *_, m in prepared]
    verifying = [1.0 if n > 1 else 0.0 for n, *_ in points]
    columns = {"step": [1.0] * len(points)}
    if len(set(tokens)) > 1:
        columns["token"] = [float(m) for m in tokens]
    if 0 < sum(verifying) < len(verifying) and len({m for m, v in zip(tokens, verifying) if v}) > 1:
        columns["verify"] = verifying
    regressors = [list(row) for row in zip(*columns.values())]
    best: tuple[float, float, float, list[float]] | None = None  # loss, eta_m, eta_c, overhead coefficients
    for eta_m in grid:
        for eta_c in grid:
            modelled = [fixed + sum(max(tm / eta_m, tc / eta_c) for tm, tc in parts) for parts, fixed, _, _ in prepared]
            resid = [y - x for x, (_, _, y, _) in zip(modelled, prepared)]
            coef = _fit_overheads(resid, regressors, weights)
            loss = sum(((x + sum(c * v for c, v in zip(coef, row)) - y) / y) ** 2
                       for x, row, (_, _, y, _) in zip(modelled, regressors, prepared))
            if best is None or loss < best[0] * (1 - 1e-9):
                best = (loss, eta_m, eta_c, coef)
    assert best is not None
    _, eta_m, eta_c, coef = best
    fitted = dict(zip(columns, coef))  # term -> seconds
    step_s, layer_s = _split_overhead(fitted["step"], shape, hw)
    cal = Calibration(eta_m, eta_c, step_s, layer_s, draft_round_s=drafts, draft_round_by_batch=by_batch, source=origin,
                      tree_round_s=trees, tree_round_by_batch=trees_by_batch,
                      token_overhead_s=fitted.get("token", 0.0), verify_overhead_s=fitted.get("verify", 0.0))
    fitted_hw = cal.apply(hw)
    residuals = tuple((n, b, y, step_cost(shape, fitted_hw, tp, n, b, c).total_s) for n, b, c, y in points)
    return replace(cal, points=residuals)


def calibrate_measured(shape: ModelShape, hw: HardwareProfile, tp: int, single_stream_tokens_per_s: float,
                       allreduce_share: float | None = None, collectives_per_token: float | None = None,
                       context: int = 2048, origin: str = "measured inputs") -> Calibration:
    """Calibrate from a profiling session: single-stream (batch 1) tokens/s, the share of decode
    time spent in AllReduce, and the number of collectives per decoded token.

    The AllReduce share fixes the per-hop link latency (the bandwidth term stays the profile's);
    the rest of the measured step is split between the modelled weight/cache reads and the
    fixed overhead. If the model's reads alone exceed it, both efficiencies are raised (at most
    to 1) so the reads fit, and the overhead is 0.
    """
    if isinstance(single_stream_tokens_per_s, bool) or not isinstance(single_stream_tokens_per_s, (int, float)) \
            or single_stream_tokens_per_s <= 0:
        raise UserError(f"{origin}: 'single_stream_tokens_per_s' must be a positive number")
    step_total = 1.0 / float(single_stream_tokens_per_s)
    cpl = None
    if collectives_per_token is not None:
        if isinstance(collectives_per_token, bool) or not isinstance(collectives_per_token, (int, float)) \
                or collectives_per_token < 0:
            raise UserError(f"{origin}: 'collectives_per_token' must be a number >= 0")
        cpl = float(collectives_per_token) / shape.num_layers
    hw1 = replace(hw, collectives_per_layer=cpl) if cpl is not None else hw
    link_latency = None
    coll_s = step_cost(shape, hw1, tp, 1, 1, context).term_s("AllReduce")
    if allreduce_share is not None:
        if isinstance(allreduce_share, bool) or not isinstance(allreduce_share, (int, float)) or not 0 <= allreduce_share < 1:
            raise UserError(f"{origin}: 'allreduce_share' must be a fraction in [0, 1)")
        if tp <= 1 and allreduce_share > 0:
            raise UserError(f"{origin}: an AllReduce share was given but tp is 1; pass --tp")
        coll_s = allreduce_share * step_total
        if tp > 1:
            count = hw1.collectives_per_layer * shape.num_layers
            if count <= 0:
                raise UserError(f"{origin}: an AllReduce share was given but collectives_per_token is 0")
            per = coll_s / count
            bytes_part = allreduce_s(shape.hidden_size * ACT_BYTES, tp, replace(hw1, link_latency_s=0.0))
            link_latency = max(0.0, per - bytes_part) / (2 * (tp - 1))
    hw2 = replace(hw1, link_latency_s=link_latency) if link_latency is not None else hw1
    reads = step_cost(shape, replace(hw2, step_overhead_s=0.0, layer_overhead_s=0.0), tp, 1, 1, context)
    reads_s = sum(t.time_s for t in reads.terms if t.bound in ("memory", "compute"))
    rest = step_total - coll_s
    if rest <= 0:
        raise UserError(f"{origin}: {single_stream_tokens_per_s:g} tokens/s leaves no time beyond the modelled "
                        f"AllReduce ({coll_s * 1e3:.2f} ms per token); give the measured 'allreduce_share'")
    eta_m, eta_c, overhead = hw.memory_efficiency, hw.compute_efficiency, rest - reads_s
    if overhead < 0:
        scale = reads_s / max(rest, 1e-12)
        eta_m, eta_c, overhead = min(1.0, eta_m * scale), min(1.0, eta_c * scale), 0.0
    step_s, layer_s = _split_overhead(overhead, shape, hw)
    cal = Calibration(eta_m, eta_c, step_s, layer_s, link_latency_s=link_latency, collectives_per_layer=cpl, source=origin)
    fitted = step_cost(shape, cal.apply(hw), tp, 1, 1, context).total_s
    return replace(cal, points=((1, 1, step_total, fitted),))
