"""What a user measured on their own cluster, and the hardware profile fitted to it.

Contract:
- ``read_measured(data)`` validates a JSON object (or ``load_measured(path)`` a file) holding any of:
  ``decode_tokens_per_s`` (plain decoding, all sequences together: a number for batch 1 or
  ``{batch: tok/s}``), ``collective_share`` (share of decode time in collectives: a number for
  batch 1 or ``{batch: share}``), ``collectives_per_token`` (per decoded token, all layers),
  ``tp``, ``context``, ``source``, and acceptance: ``acceptance`` (records of ``outrider bench
  --json``), ``vllm_metrics`` (vLLM's Prometheus counters ``vllm:spec_decode_num_drafts``,
  ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos{position=i}``, as scraped text
  or as numbers) and ``sglang_metrics`` (``sglang:spec_accept_length`` / server info's
  ``avg_spec_accept_length``), each with its ``method`` and ``k`` (a topk-1 tree record is the chain
  k = steps; wider tree records belong in ``plan --acceptance``); or the list of records
  ``outrider bench --server --json`` writes (``plan.served_records``). The older keys
  ``single_stream_tokens_per_s`` and ``allreduce_share`` mean batch-1 decode and share.
- ``fit_profile(shape, hw, tp, measured)`` fits the profile's free parameters: collectives per
  layer (from the count), per-collective latency and, with shares at two or more batch sizes, the
  link's effective bandwidth (ring AllReduce time, linear in both); then memory and compute
  efficiency and the per-forward overhead to the decode times less their collectives (grid over
  the efficiencies, least squares for the overhead, relative errors). A parameter the
  measurements cannot move (changing it changes no fitted time) keeps the profile's value and is
  reported as unconstrained. ``Fit.changes`` says what moved and by how much.

Not done here: measuring (the user's profiler), step times from our own bench (``calibrate``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from outrider.errors import UserError
from outrider.fsutil import read_json, read_text
from outrider.plan.acceptance import Acceptance
from outrider.plan.cost_model import ModelShape, forward_overhead_s, step_cost
from outrider.plan.hardware import ACT_BYTES, HardwareProfile
from outrider.plan.served_records import is_served
from outrider.plan.served_records import measurements as served_measurements
from outrider.records import record_of
from outrider.trees import budget_of

KEYS = ("decode_tokens_per_s", "collective_share", "collectives_per_token", "tp", "context", "source",
        "acceptance", "vllm_metrics", "sglang_metrics", "single_stream_tokens_per_s", "allreduce_share")


@dataclass(frozen=True)
class Measured:
    decode: dict[int, float]  # batch -> plain decode tokens/s, all sequences together
    share: dict[int, float]  # batch -> share of decode time in collectives
    collectives_per_token: float | None
    tp: int | None
    context: int | None
    acceptance: dict[str, dict[int, Acceptance]]  # method -> k -> acceptance
    source: str


def _number(v: Any, what: str, origin: str, lo: float = 0.0, hi: float = math.inf, open_lo: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or (v <= lo if open_lo else v < lo) or v > hi:
        bound = f"> {lo:g}" if open_lo else f">= {lo:g}"
        raise UserError(f"{origin}: '{what}' must be a number {bound}{'' if hi == math.inf else f' and <= {hi:g}'}, "
                        f"got {v!r}")
    return float(v)


def _by_batch(v: Any, what: str, origin: str, hi: float = math.inf) -> dict[int, float]:
    if not isinstance(v, Mapping):
        return {1: _number(v, what, origin, hi=hi)}
    out = {}
    for key, x in v.items():
        try:
            b = int(key)
        except (TypeError, ValueError):
            raise UserError(f"{origin}: keys of '{what}' must be batch sizes, got {key!r}") from None
        if b < 1:
            raise UserError(f"{origin}: batch sizes in '{what}' must be >= 1, got {b}")
        out[b] = _number(x, f"{what}[{key}]", origin, hi=hi)
    return out


_PROM = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)')


def _prometheus(text: str) -> dict[tuple[str, str], float]:
    """(metric name without ``_total``, position label or '') -> value summed over other labels."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _PROM.match(line.strip())
        if not m or line.lstrip().startswith("#") or m.group(1).endswith("_created"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        pos = re.search(r'position="(\d+)"', m.group(2) or "")
        key = (m.group(1).removesuffix("_total"), pos.group(1) if pos else "")
        out[key] = out.get(key, 0.0) + value
    return out


def _method_k(spec: Mapping[str, Any], what: str, origin: str) -> tuple[str, int | None]:
    method = spec.get("method")
    if not isinstance(method, str) or not method:
        raise UserError(f"{origin}: '{what}' needs a 'method' (eagle3, ngram or draft)")
    k = spec.get("k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise UserError(f"{origin}: 'k' of '{what}' must be an integer >= 1")
    return method, k


def _text(spec: Mapping[str, Any], origin: str, base: Path | None) -> str | None:
    if "text" in spec:
        return str(spec["text"])
    if "file" in spec:
        path = Path(str(spec["file"])).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        try:
            return read_text(path)
        except OSError as e:
            raise UserError(f"{origin}: cannot read metrics file {path}: {e}") from None
    return None


def acceptance_from_vllm(spec: Mapping[str, Any], origin: str = "vllm_metrics",
                         base: Path | None = None) -> tuple[str, int, Acceptance]:
    """vLLM's counters -> acceptance: u_i = accepted_per_pos[i] / drafts is P(at least i+1 drafts
    accepted) and tau = 1 + accepted / drafts (vLLM's mean acceptance length)."""
    method, k = _method_k(spec, "vllm_metrics", origin)
    text = _text(spec, origin, base)
    if text is not None:
        prom = _prometheus(text)
        drafts = prom.get(("vllm:spec_decode_num_drafts", ""))
        accepted = prom.get(("vllm:spec_decode_num_accepted_tokens", ""))
        per_pos_map = {int(p): v for (name, p), v in prom.items()
                       if name == "vllm:spec_decode_num_accepted_tokens_per_pos" and p}
        per_pos = [per_pos_map[i] for i in sorted(per_pos_map)]
    else:
        drafts, accepted, per_pos = spec.get("num_drafts"), spec.get("num_accepted_tokens"), spec.get("accepted_per_pos")
    if drafts is None or per_pos is None or not per_pos:
        raise UserError(f"{origin}: vLLM metrics need vllm:spec_decode_num_drafts and "
                        f"vllm:spec_decode_num_accepted_tokens_per_pos (or num_drafts and accepted_per_pos)")
    drafts = _number(drafts, "num_drafts", origin)
    per_pos = [_number(v, "accepted_per_pos", origin, open_lo=False) for v in per_pos]
    accepted = sum(per_pos) if accepted is None else _number(accepted, "num_accepted_tokens", origin, open_lo=False)
    k = k or len(per_pos)
    record = {"method": method, "k": k, "accept_rate_per_pos": [min(1.0, v / drafts) for v in per_pos[:k]],
              "tau": 1.0 + accepted / drafts}
    acc = Acceptance.from_record(record, origin=f"{origin} (vLLM)")
    return method, k, acc


def acceptance_from_sglang(spec: Mapping[str, Any], origin: str = "sglang_metrics",
                           base: Path | None = None) -> tuple[str, int, Acceptance]:
    """SGLang's mean acceptance length (tokens per verification, bonus included) at k drafts."""
    method, k = _method_k(spec, "sglang_metrics", origin)
    if k is None:
        raise UserError(f"{origin}: 'k' is needed with SGLang metrics (--speculative-num-steps of a chain)")
    tau = spec.get("spec_accept_length", spec.get("avg_spec_accept_length"))
    states = spec.get("internal_states")
    if tau is None and isinstance(states, list) and states and isinstance(states[0], Mapping):
        tau = states[0].get("avg_spec_accept_length")
    text = _text(spec, origin, base)
    if tau is None and text is not None:
        tau = _prometheus(text).get(("sglang:spec_accept_length", ""))
    if tau is None:
        raise UserError(f"{origin}: SGLang metrics need spec_accept_length (sglang:spec_accept_length, or "
                        f"avg_spec_accept_length of /get_server_info)")
    tau = _number(tau, "spec_accept_length", origin, lo=1.0, open_lo=False)
    return method, k, Acceptance.from_tau(tau, k, source=f"{origin} (SGLang): accept length {tau:g} at k={k}")


def read_measured(data: Any, origin: str = "measured", base: Path | None = None) -> Measured:
    if is_served(data):  # the records of `outrider bench --server --json`
        data = served_measurements(data, origin)
    if not isinstance(data, Mapping):
        raise UserError(f"{origin}: measurements must be a JSON object (keys: {', '.join(KEYS[:9])})")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise UserError(f"{origin}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(KEYS)})")
    decode = _by_batch(data.get("decode_tokens_per_s", data.get("single_stream_tokens_per_s", {})),
                       "decode_tokens_per_s", origin)
    share = _by_batch(data.get("collective_share", data.get("allreduce_share", {})), "collective_share", origin,
                      hi=0.999)
    missing = sorted(set(share) - set(decode))
    if missing:
        raise UserError(f"{origin}: a collective share was given at batch {missing[0]} without the decode "
                        f"tokens/s at that batch")
    count = data.get("collectives_per_token")
    count = None if count is None else _number(count, "collectives_per_token", origin)
    tp = data.get("tp")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise UserError(f"{origin}: 'tp' must be an integer >= 1")
    context = data.get("context")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 0):
        raise UserError(f"{origin}: 'context' must be an integer >= 0")
    accept: dict[str, dict[int, Acceptance]] = {}
    recs = data.get("acceptance")
    if recs is not None:
        recs = [recs] if isinstance(recs, Mapping) else recs
        if not isinstance(recs, list):
            raise UserError(f"{origin}: 'acceptance' must be bench records (a list of JSON objects)")
        for i, r in enumerate(recs):
            r = record_of(r, f"{origin}: 'acceptance' record {i}")
            if r.tree is not None:  # topk 1: the chain k = steps; wider: --acceptance
                budget = budget_of(r, f"{origin}: 'acceptance' tree record")
                if not budget.is_chain:
                    raise UserError(f"{origin}: 'acceptance' holds a tree record ({budget.label()}): give tree "
                                    "records with --acceptance")
                r = {**r, "k": budget.steps}
            method, k = _method_k(r, "acceptance", origin)
            if method != "ar":
                accept.setdefault(method, {})[k or len(r.get("accept_rate_per_pos") or [])] = \
                    Acceptance.from_record(r, origin=origin)
    for key, reader in (("vllm_metrics", acceptance_from_vllm), ("sglang_metrics", acceptance_from_sglang)):
        specs = data.get(key)
        if specs is None:
            continue
        for spec in ([specs] if isinstance(specs, Mapping) else specs):
            if not isinstance(spec, Mapping):
                raise UserError(f"{origin}: '{key}' must be an object or a list of objects")
            method, k, acc = reader(spec, origin, base)
            accept.setdefault(method, {})[k] = acc
    return Measured(decode, share, count, tp, context, accept, str(data.get("source", origin)))


def measured_json(path: str | Path) -> Any:
    return read_json(path, "measurements")


def load_measured(source: "str | Path | Mapping[str, Any] | Measured") -> Measured:
    """A ``Measured`` from a file, a JSON-like mapping, or itself."""
    if isinstance(source, Measured):
        return source
    if isinstance(source, Mapping):
        return read_measured(source, "measurements")
    p = Path(source).expanduser()
    return read_measured(measured_json(p), p.name, p.parent)


def measured_from(path: str | None, decode: Mapping[int, float] | None = None,
                  share: Mapping[int, float] | None = None, count: float | None = None) -> "str | Measured | None":
    """A file's measurements with values given one by one (command-line flags) over them, batch by batch."""
    if decode is None and share is None and count is None:
        return path
    data = measured_json(path) if path else {}
    if path and is_served(data):
        data = served_measurements(data, Path(path).name)
    if not isinstance(data, dict):
        raise UserError(f"{path}: measurements must be a JSON object")
    data = dict(data)
    for key, given in (("decode_tokens_per_s", decode), ("collective_share", share)):
        if given is not None:  # batch by batch over the file's
            old = data.get(key, {})
            merged = {str(k): v for k, v in old.items()} if isinstance(old, Mapping) else {"1": old}
            merged.update({str(b): v for b, v in given.items()})
            data[key] = merged
    if count is not None:
        data["collectives_per_token"] = count
    return read_measured(data, f"{Path(path).name} and flags" if path else "measurements given as flags",
                         Path(path).expanduser().parent if path else None)


# --------------------------------------------------------------------------------------------
# Fitting


@dataclass(frozen=True)
class Change:
    name: str
    before: float
    after: float
    unit: str
    constrained: bool  # False: the measurements do not move it; the profile's value is kept

    @property
    def moved(self) -> bool:
        return self.constrained and abs(self.after - self.before) > 0.01 * max(abs(self.before), 1e-12)

    def text(self) -> str:
        if not self.constrained:
            return f"{self.name}: {self._fmt(self.before)} (not constrained by the measurements; kept)"
        if not self.moved:
            return f"{self.name}: {self._fmt(self.before)} (unchanged)"
        ratio = f"x{self.after / self.before:.2f}" if self.before else "from 0"
        return f"{self.name}: {self._fmt(self.before)} -> {self._fmt(self.after)} ({ratio})"

    def _fmt(self, v: float) -> str:
        scale = {"us": 1e6, "ms": 1e3, "GB/s": 1e-9}.get(self.unit, 1.0)
        return f"{v * scale:.3g}{' ' + self.unit if self.unit else ''}"


@dataclass(frozen=True)
class Fit:
    profile: HardwareProfile
    changes: tuple[Change, ...]
    points: tuple[tuple[int, float, float], ...]  # (batch, measured tok/s, fitted tok/s)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def max_relative_error(self) -> float:
        return max((abs(f - m) / m for _, m, f in self.points), default=0.0)

    def summary(self) -> str:
        moved = [c.text() for c in self.changes if c.moved]
        return (f"fitted to {len(self.points)} decode rate(s), worst residual {self.max_relative_error:.1%}; moved: "
                + ("; ".join(moved) if moved else "nothing"))


def _link_bw(hw: HardwareProfile) -> float:
    return hw.link_bandwidth_bytes_per_s * hw.link_efficiency


def fit_profile(shape: ModelShape, hw: HardwareProfile, tp: int, measured: Measured, context: int = 2048) -> Fit:
    """Fit the profile's free parameters to ``measured`` (see the module docstring)."""
    if not measured.decode:
        raise UserError(f"{measured.source}: no decode tokens/s to fit the profile to ('decode_tokens_per_s')")
    if measured.tp is not None and measured.tp != tp:
        raise UserError(f"{measured.source}: measured at tp {measured.tp} but the plan is for tp {tp}: pass --tp "
                        f"{measured.tp}")
    L, notes = shape.num_layers, []
    fitted = hw
    if measured.collectives_per_token is not None:
        fitted = replace(fitted, collectives_per_layer=measured.collectives_per_token / L)
    count = fitted.collectives_per_layer * L
    if measured.share and tp <= 1:
        raise UserError(f"{measured.source}: a collective share was given but tp is 1; pass --tp")
    if measured.share and count <= 0:
        raise UserError(f"{measured.source}: a collective share was given but collectives_per_token is 0")
    hops = 2 * (tp - 1)
    if measured.share:
        # per collective: hops * latency + hops/tp * bytes * g, with g = 1 / effective link bandwidth
        rows, ys = [], []
        for b, s in sorted(measured.share.items()):
            per = s * (b / measured.decode[b]) / count
            rows.append([hops, hops / tp * b * shape.hidden_size * ACT_BYTES])
            ys.append(per)
        A, y = np.array(rows), np.array(ys)
        g0 = 1.0 / _link_bw(fitted)
        if len(ys) >= 2 and len({r[1] for r in rows}) >= 2:
            coef, *_ = np.linalg.lstsq(A / y[:, None], np.ones_like(y), rcond=None)
            lat, g = float(coef[0]), float(coef[1])
            if lat < 0 or g <= 0:  # keep the bandwidth, fit the latency alone
                lat, g = max(0.0, float(np.mean((y - A[:, 1] * g0) / A[:, 0]))), g0
        else:
            lat, g = max(0.0, float(np.mean((y - A[:, 1] * g0) / A[:, 0]))), g0
        bw = 1.0 / g
        eff = min(1.0, bw / fitted.link_bandwidth_bytes_per_s)
        fitted = replace(fitted, link_latency_s=lat, link_efficiency=eff,
                         link_bandwidth_bytes_per_s=max(fitted.link_bandwidth_bytes_per_s, bw / eff))
    fitted = _fit_rest(shape, fitted, tp, measured, context, notes)
    points = tuple((b, tps, b / step_cost(shape, fitted, tp, 1, b, context).total_s)
                   for b, tps in sorted(measured.decode.items()))
    return Fit(fitted, _changes(shape, hw, fitted, measured), points, tuple(notes))


def _fit_rest(shape: ModelShape, hw: HardwareProfile, tp: int, measured: Measured, context: int,
              notes: list[str]) -> HardwareProfile:
    """Memory and compute efficiency and the per-forward overhead, to the decode times less collectives."""
    base = replace(hw, memory_efficiency=1.0, compute_efficiency=1.0, step_overhead_s=0.0, layer_overhead_s=0.0,
                   token_overhead_s=0.0, verify_overhead_s=0.0)
    prepared = []  # per batch: [(t_mem, t_cmp)] at efficiency 1, collective seconds, measured seconds
    for b, tps in sorted(measured.decode.items()):
        cost = step_cost(shape, base, tp, 1, b, context)
        parts = [(t.bytes / base.memory_ceiling_bytes_per_s, t.flops / base.flops_ceiling_per_s(t.compute))
                 for t in cost.terms if t.bound in ("memory", "compute")]
        prepared.append((parts, cost.term_s("AllReduce"), b / tps))
    for _, coll, y in prepared:
        if coll >= y:
            raise UserError(f"{measured.source}: the modelled collectives ({coll * 1e3:.2f} ms) exceed the measured "
                            f"step ({y * 1e3:.2f} ms); give the measured 'collective_share'")

    def solve(eta_m: float, eta_c: float) -> tuple[float, float]:
        """(loss, overhead) for these efficiencies: overhead by weighted least squares, >= 0."""
        model = [coll + sum(max(tm / eta_m, tc / eta_c) for tm, tc in parts) for parts, coll, _ in prepared]
        w = [1.0 / (y * y) for *_, y in prepared]
        o = max(0.0, sum(wi * (y - x) for wi, x, (*_, y) in zip(w, model, prepared)) / sum(w))
        return sum(((x + o - y) / y) ** 2 for x, (*_, y) in zip(model, prepared)), o

    eta_m, eta_c = hw.memory_efficiency, hw.compute_efficiency
    if len(prepared) == 1:
        loss, o = solve(eta_m, eta_c)
        if loss > 1e-12:  # the reads alone exceed the step: raise both efficiencies until they fit
            parts, coll, y = prepared[0]
            reads = sum(max(tm / eta_m, tc / eta_c) for tm, tc in parts)
            scale = reads / (y - coll)
            eta_m, eta_c, o = min(1.0, eta_m * scale), min(1.0, eta_c * scale), 0.0
            notes.append("the measured step is faster than the profile's reads: efficiencies raised")
    else:
        grid = [10 ** (-1 + i / 40) for i in range(41)]  # 0.1 .. 1.0: below, a term is mis-modelled, not slow

        def golden(f, x: float) -> float:
            """Minimise f within a grid step of x (log-spaced grid), golden-section search."""
            lo, hi = max(0.1, x / 1.06), min(1.0, x * 1.06)
            for _ in range(40):
                x1, x2 = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
                lo, hi = (lo, x2) if f(x1) <= f(x2) else (x1, hi)
            return (lo + hi) / 2

        def best_m(c: float) -> tuple[float, float]:
            """(memory efficiency, loss) that fit best at compute efficiency c."""
            m = golden(lambda x: solve(x, c)[0], min(grid, key=lambda x: solve(x, c)[0]))
            return m, solve(m, c)[0]

        # decode steps are mostly memory-bound: first the memory efficiency (and overhead) alone; the
        # compute efficiency moves only where it halves the squared error (compute-bound points)
        eta_m, loss = best_m(eta_c)
        c2 = min(grid, key=lambda c: best_m(c)[1])
        c2 = golden(lambda c: best_m(c)[1], c2)
        m2, loss2 = best_m(c2)
        if loss2 < 0.5 * loss - 1e-15:
            eta_m, eta_c, loss = m2, c2, loss2
        if solve(hw.memory_efficiency, eta_c)[0] <= loss * (1 + 1e-6) + 1e-15:
            eta_m = hw.memory_efficiency  # nothing the measurements show depends on it
        o = solve(eta_m, eta_c)[1]
    layer_part = hw.layer_overhead_s * (shape.num_layers + 1)
    total = hw.step_overhead_s + layer_part
    step_s, layer_s = (o * hw.step_overhead_s / total, hw.layer_overhead_s * o / total) if total > 0 else (o, 0.0)
    return replace(hw, memory_efficiency=eta_m, compute_efficiency=eta_c, step_overhead_s=step_s,
                   layer_overhead_s=layer_s)


def _changes(shape: ModelShape, before: HardwareProfile, after: HardwareProfile, measured: Measured
             ) -> tuple[Change, ...]:
    several = len(measured.decode) >= 2
    share_b = len(measured.share) >= 2
    return (
        Change("memory efficiency", before.memory_efficiency, after.memory_efficiency, "",
               several or after.memory_efficiency != before.memory_efficiency),
        Change("compute efficiency", before.compute_efficiency, after.compute_efficiency, "",
               after.compute_efficiency != before.compute_efficiency),
        Change("per-forward overhead", forward_overhead_s(shape, before), forward_overhead_s(shape, after), "ms", True),
        Change("collectives per layer", before.collectives_per_layer, after.collectives_per_layer, "",
               measured.collectives_per_token is not None),
        Change("link latency per ring hop", before.link_latency_s, after.link_latency_s, "us", bool(measured.share)),
        Change("effective link bandwidth", _link_bw(before), _link_bw(after), "GB/s", share_b),
    )

