"""``outrider bench --server``: the engine the user serves, measured from outside, level by level.

Contract:
- ``served_bench(server, texts, concurrency, ...)`` probes the server (``client.Endpoint``), then
  for each concurrency c in order scrapes ``/metrics``, streams every prompt (chat template
  applied by the server; greedy unless ``temperature`` > 0) with c requests in flight, scrapes
  again, and makes one record per level (``level_record``). With ``baseline`` (a plain server) the
  same levels run there too and each speculative record gets ``speedup_vs_baseline`` (total
  tokens/s over the baseline's at that c).
- A record: ``kind: "served"``, ``method`` (``ar`` for a plain server), ``k``, ``concurrency``
  (and ``batch``, the same), ``num_prompts`` sent (``max_in_flight``: fewer than c when the
  prompts are), ``completed``, ``failed`` with the first errors, ``new_tokens``, ``tokens_per_s``
  (all requests' tokens over the level's wall time, prefill included),
  ``tokens_per_s_per_request`` (median of tokens over each request's latency),
  ``ttft_ms_p50/p99``, ``itl_ms_p50/p99`` (gaps between streamed content chunks, vLLM's benchmark
  definition: a chunk may carry several tokens), ``tpot_ms`` (median of (latency - TTFT) / (tokens
  - 1)), the step times the planner's ``--calibrate`` reads (``ar_step_ms`` = TPOT on a plain
  server; ``verify_step_ms`` = TPOT x tau, a whole speculative step, drafting included), the
  acceptance (``served.metrics``: tau, per position, or "no acceptance counters"), ``engine``,
  ``engine_version``, ``outputs``, ``date``, ``git_commit``.
- Every level's records are written (``json_path``, atomically) as soon as it ends, so a fault
  later keeps what was measured. Any failed request (HTTP error, stall past ``timeout``, a
  broken stream) stops the run after its level; the caller receives the records and one line
  naming the first failure.

Not done here: starting servers, open-loop (Poisson) arrival, sampling-mode checks.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

from outrider.errors import UserError
from outrider.provenance import git_commit, today
from outrider.records import new_record, write_records
from outrider.bench.served.client import Endpoint, Reply
from outrider.bench.served.metrics import Served, acceptance, engine_of, parse_exposition


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation, None when there are no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def _run_level(ep: Endpoint, texts: Sequence[str], concurrency: int, max_tokens: int, temperature: float,
               seed: int | None) -> tuple[list[Reply], float]:
    replies: list[Reply | None] = [None] * len(texts)

    def one(i: int) -> None:
        replies[i] = ep.stream([{"role": "user", "content": texts[i]}], max_tokens, temperature, seed)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(len(texts))))
    return [r for r in replies if r is not None], time.perf_counter() - t0


def level_record(replies: Sequence[Reply], wall_s: float, concurrency: int, served: Served) -> dict[str, Any]:
    """The timing figures of one level (see the module docstring) and its acceptance."""
    ok = [r for r in replies if r.error is None]
    ttft = [r.first - r.sent for r in ok if r.first is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    tpot = [(r.done - r.first) / (r.tokens - 1) for r in ok if r.first is not None and r.tokens > 1]
    per_req = [r.tokens / (r.done - r.sent) for r in ok if r.done > r.sent]
    tokens = sum(r.tokens for r in ok)
    tpot_s = statistics.median(tpot) if tpot else None
    rec: dict[str, Any] = {
        "concurrency": concurrency, "batch": concurrency, "completed": len(ok), "failed": len(replies) - len(ok),
        "errors": [r.error for r in replies if r.error is not None][:3],
        "new_tokens": tokens, "tokens_counted_from": sorted({r.tokens_from for r in ok}),
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "tokens_per_s_per_request": statistics.median(per_req) if per_req else None,
        "ttft_ms_p50": _ms(percentile(ttft, 50)), "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "itl_ms_p50": _ms(percentile(itl, 50)), "itl_ms_p99": _ms(percentile(itl, 99)),
        "tpot_ms": _ms(tpot_s), "wall_s": wall_s,
        "prompt_tokens": [r.prompt_tokens for r in replies],
        "outputs": [r.text if r.error is None else None for r in replies],
        "finish_reasons": [r.finish_reason for r in replies],
    }
    rec.update(served.to_dict())
    if served.tau is None:
        rec["ar_step_ms"] = _ms(tpot_s)
    elif tpot_s is not None:
        rec["verify_step_ms"] = _ms(tpot_s * served.tau)
    return rec


def _scrape(ep: Endpoint, reachable: bool = True) -> list | None:
    text = ep.scrape(reachable)
    return None if text is None else parse_exposition(text)


def _engine(ep: Endpoint, samples: list | None) -> tuple[str | None, str | None, dict[str, Any]]:
    info = ep.engine_info()
    version = next((str(d["version"]) for d in info.values() if isinstance(d.get("version"), (str, int, float))), None)
    return engine_of(samples or []), version, info.get("/get_server_info", {})


def run_server(server: str, texts: Sequence[str], concurrency: Sequence[int], max_tokens: int,
               model: str | None = None, temperature: float = 0.0, seed: int | None = None, timeout: float = 60.0,
               method: str = "ar", role: str = "server", done: Callable[[list[dict[str, Any]]], None] | None = None,
               log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """All levels against one server; ``done`` receives the records so far after every level."""
    commit = git_commit()  # once: the code that measures every level
    ep = Endpoint(server, model, timeout)
    name = ep.probe()
    first = _scrape(ep)
    engine, version, server_info = _engine(ep, first)
    sglang_k = server_info.get("speculative_num_steps")
    records: list[dict[str, Any]] = []
    before = first
    for c in concurrency:
        replies, wall = _run_level(ep, texts, c, max_tokens, temperature, seed)
        after = _scrape(ep, reachable=False)  # a server that died in the level: its records are still kept
        served = acceptance(engine, before, after, sglang_k if isinstance(sglang_k, int) else None)
        before = after
        rec: dict[str, Any] = {"kind": "served", "role": role, "server": ep.base, "model": name, "engine": engine or "unknown",
               "engine_version": version, "method": method if served.tau is not None else "ar",
               "num_prompts": len(texts), "max_in_flight": min(c, len(texts)), "max_new_tokens": max_tokens,
               "temperature": temperature, "timeout_s": timeout}
        rec.update(level_record(replies, wall, c, served))
        if served.tau is None:
            rec["k"] = 0  # as far as the engine tells: plain decoding
        rec.update({"device": f"served ({engine or 'unknown engine'})", "dtype": None,
                    "date": today(), "git_commit": commit})
        records.append(new_record("served", rec))
        if log is not None:
            short = f" (only {len(texts)} prompts: at most {len(texts)} in flight; raise --num-prompts)" \
                if c > len(texts) else ""
            log(f"{role} concurrency {c}: {rec['completed']}/{len(texts)} requests in {wall:.1f} s{short}")
        if done is not None:
            done(records)
        if rec["failed"]:
            break
    return records


def add_speedups(spec: list[dict[str, Any]], base: list[dict[str, Any]]) -> None:
    """``speedup_vs_baseline`` on each speculative record: its total tokens/s over the baseline's."""
    by_c = {r["concurrency"]: r for r in base if r.get("tokens_per_s")}
    for r in spec:
        b = by_c.get(r["concurrency"])
        if b is not None and r.get("tokens_per_s"):
            r["baseline_tokens_per_s"] = b["tokens_per_s"]
            r["speedup_vs_baseline"] = r["tokens_per_s"] / b["tokens_per_s"]


def served_bench(server: str, texts: Sequence[str], concurrency: Sequence[int], max_tokens: int = 128,
                 model: str | None = None, baseline: str | None = None, baseline_model: str | None = None,
                 temperature: float = 0.0, seed: int | None = None, timeout: float = 60.0, method: str = "eagle3",
                 json_path: str | None = None, log: Callable[[str], None] | None = None
                 ) -> tuple[list[dict[str, Any]], str | None]:
    """The levels against ``server`` (and ``baseline``): (records, the failure that stopped the run
    or None). A file ``json_path`` receives the records after every level."""
    results: dict[str, list[dict[str, Any]]] = {"server": [], "baseline": []}

    def save(role: str) -> Callable[[list[dict[str, Any]]], None]:
        def write(records: list[dict[str, Any]]) -> None:
            results[role] = list(records)
            if json_path and json_path != "-":
                write_records(json_path, results["server"] + results["baseline"])
        return write

    def failed(records: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next((r for r in records if r["failed"]), None)

    spec = run_server(server, texts, concurrency, max_tokens, model, temperature, seed, timeout, method, "server",
                      save("server"), log)
    bad = failed(spec)
    if bad is None and baseline is not None:
        base = run_server(baseline, texts, concurrency, max_tokens, baseline_model or model, temperature, seed,
                          timeout, "ar", "baseline", save("baseline"), log)
        for r in base:
            r["method"], r["k"] = "ar", 0
        add_speedups(spec, base)
        save("server")(spec)
        bad = failed(base)
    if bad is None:
        return results["server"] + results["baseline"], None
    return results["server"] + results["baseline"], (
        f"{bad['failed']} of {bad['num_prompts']} requests failed at concurrency {bad['concurrency']} on "
        f"{bad['server']} (first: {bad['errors'][0]})")


def compare(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records of run ``a`` with ``speedup_vs_baseline`` over run ``b`` at each shared concurrency
    (``records.Record``s or their JSON form)."""
    for recs, name in ((a, "first"), (b, "second")):
        if not recs or not all(r.get("kind") == "served" for r in recs):
            raise UserError(f"--compare: the {name} file holds no served records (write them with "
                            "`outrider bench --server URL --json F`)")
    out = [dict(r) for r in a]
    add_speedups(out, b)
    if not any("speedup_vs_baseline" in r for r in out):
        raise UserError("--compare: the two runs share no concurrency level with a throughput")
    return out


def print_table(records: Sequence[dict[str, Any]], console) -> None:
    from rich.table import Table

    table = Table(title="outrider bench --server")
    for col in ("run", "c", "ok", "tok/s", "req tok/s", "TTFT ms", "ITL p50", "ITL p99", "tau", "acc/pos",
                "vs base"):
        table.add_column(col, justify="right")

    def f(x: Any, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    for r in records:
        acc = " ".join(f"{a:.2f}" for a in r.get("accept_rate_per_pos") or []) or "-"
        table.add_row(r.get("role", "server"), str(r["concurrency"]), f"{r['completed']}/{r['num_prompts']}",
                      f(r.get("tokens_per_s")), f(r.get("tokens_per_s_per_request")), f(r.get("ttft_ms_p50")),
                      f(r.get("itl_ms_p50")), f(r.get("itl_ms_p99")), f(r.get("tau"), ".2f"), acc,
                      "-" if r.get("speedup_vs_baseline") is None else f"{r['speedup_vs_baseline']:.2f}x")
    console.print(table)
    console.print("tok/s: all requests' tokens over the level's wall time; TTFT p50; ITL: gaps between streamed "
                  "chunks (ms)", highlight=False)
    for src in sorted({(r.get("role", "server"), r.get("engine"), r.get("engine_version"), r.get("acceptance"))
                       for r in records}, key=str):
        console.print(f"{src[0]}: engine {src[1]}{' ' + str(src[2]) if src[2] else ''}; acceptance: {src[3]}",
                      highlight=False)
