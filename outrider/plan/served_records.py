"""Served records (``outrider bench --server --json``) as the planner's measurements.

Contract: ``is_served(data)`` tells a list of served records (``kind: "served"``) from the other
measurement files; ``measurements(records, origin)`` turns them into the JSON object
``plan.measured.read_measured`` reads: ``decode_tokens_per_s`` by concurrency from the plain
records (a baseline server, or a server whose engine shows no speculation: ``method`` ``ar``),
their ``tokens_per_s`` (all requests' tokens over the level's wall time, prefill included), and
``acceptance`` from the speculative records (read by ``outrider.records``) (tau and acceptance per position from the engine's
counters, the lowest concurrency's per method and k). A failed level's records are skipped;
a file with nothing usable is a ``UserError``. Step times for ``plan --calibrate`` need no
conversion: the records carry ``ar_step_ms`` / ``verify_step_ms`` at their ``batch``.

Not done here: measuring (``outrider.bench.served``), fitting (``plan.measured``).
"""

from __future__ import annotations

from typing import Any

from outrider.errors import UserError
from outrider.records import records_of


def is_served(data: Any) -> bool:
    return isinstance(data, list) and bool(data) and all(isinstance(r, dict) and r.get("kind") == "served"
                                                         for r in data)


def measurements(data: list[Any], origin: str) -> dict[str, Any]:
    decode: dict[str, float] = {}
    accept: dict[tuple[str, int], dict[str, Any]] = {}
    records = records_of(data, origin)
    for r in sorted(records, key=lambda r: r.get("concurrency", 0)):
        if r.get("failed") or not r.get("completed"):
            continue
        c, tps = r.get("concurrency"), r.tokens_per_s
        if r.tau is None:
            if isinstance(c, int) and tps is not None and tps > 0:
                decode.setdefault(str(c), tps)
        elif r.k is not None and r.k >= 1:
            accept.setdefault((r.method, r.k), {key: r[key] for key in ("method", "k", "tau", "accept_rate_per_pos")})
    if not decode and not accept:
        raise UserError(f"{origin}: no completed served level to plan from (rerun `outrider bench --server`)")
    out: dict[str, Any] = {"source": f"{origin} (served: {', '.join(sorted({str(r.get('engine')) for r in records}))})"}
    if decode:
        out["decode_tokens_per_s"] = decode
    if accept:
        out["acceptance"] = list(accept.values())
    return out
