"""The report page: one self-contained HTML file from what ``report.inputs`` recognised.

Contract: ``render(inputs)`` returns the page; ``write_report(paths, out)`` loads the inputs,
renders and writes the page atomically (``fsutil``), and returns the notes it printed on it.
Sections appear only when the inputs allow them (their ids are ``SECTIONS``' keys): training
curves against steps and training time, acceptance per draft position, speedup and tau against k
(and batch), served throughput and latency against concurrency, the step-time breakdown, the
training plan, and the sources. Every table row and every chart caption cites its records as
``[n] device · date · commit``, ``n`` numbering the sources table. Charts are SVG images inlined
as ``data:`` URIs (``report.plots``); the page loads nothing from the network, runs no script and
has no external style. Without matplotlib the page keeps its tables and says, in each chart's
place, that charts need it.
"""

from __future__ import annotations

import base64
import html
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from outrider.fsutil import atomic_write_text
from outrider.provenance import today
from outrider.report import plots
from outrider.report.inputs import Inputs, Run, Source, load
from outrider.report.plots import Panel, Series

SECTIONS = {
    "training": "Training curves",
    "acceptance": "Acceptance per draft position",
    "speed": "Speedup and tau against k and batch",
    "served": "Served: throughput and latency against concurrency",
    "breakdown": "Where a round's time goes",
    "train-plan": "Training plan",
    "sources": "Sources",
}
GENERATOR = "outrider report"
SMOOTH_OVER = 100  # a training series longer than this is drawn faint, under its running mean
STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;
color:#1b1f24;padding:0 16px}
h1{font-size:1.5em}h2{border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:36px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:.86em}
th,td{border:1px solid #d0d7de;padding:3px 7px;text-align:right}th{background:#f6f8fa}
td.l,th.l{text-align:left}figure{margin:8px 0 20px}figure img{max-width:100%}
figcaption,.cite{color:#57606a;font-size:.82em}.note{background:#fff8c5;padding:6px 10px;border-radius:4px}
nav a{margin-right:14px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, (int, float)):
        return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"
    return str(x)


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """A table whose first ``left`` columns (and the last, the citation) are left-aligned."""
    def cell(tag: str, i: int, v: Any, n: int) -> str:
        cls = ' class="l"' if i < left or i == n - 1 else ""
        return f"<{tag}{cls}>{_e(v)}</{tag}>"

    out = ["<table><tr>" + "".join(cell("th", i, h, len(head)) for i, h in enumerate(head)) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(cell("td", i, v, len(r)) for i, v in enumerate(r)) + "</tr>")
    return "\n".join(out) + "</table>"


def _cites(sources: Sequence[Source]) -> str:
    seen: dict[int, Source] = {s.index: s for s in sources}
    return "; ".join(s.cite() for _, s in sorted(seen.items()))


def _figure(draw: Callable[[], bytes], alt: str, sources: Sequence[Source]) -> str:
    caption = f"<figcaption>{_e(alt)}. From {_e(_cites(sources))}.</figcaption>"
    if not plots.available():
        return f'<figure><p class="note">{_e(alt)}: charts need matplotlib ({_e(plots.INSTALL)}).</p>{caption}</figure>'
    data = base64.b64encode(draw()).decode("ascii")
    return f'<figure><img alt="{_e(alt)}" src="data:image/svg+xml;base64,{data}">{caption}</figure>'


def _section(key: str, body: list[str]) -> str:
    return f'<section id="{key}"><h2>{_e(SECTIONS[key])}</h2>\n' + "\n".join(body) + "\n</section>"


# --------------------------------------------------------------------------------------------
# Training


def _clock(run: Run) -> list[float]:
    """Training seconds at each logged step: the logged ``train_s``, else the steps' own times summed
    (tokens over tokens/s; with ``log_every`` > 1 that counts the logged steps only)."""
    out, total = [], 0.0
    for r in run.train:
        total += r.get("tokens", 0) / r["tokens_per_s"] if r.get("tokens_per_s") else 0.0
        out.append(float(r["train_s"]) if "train_s" in r else total)
    return out


def _running_mean(values: list[float], w: int) -> list[float]:
    """The mean of each ``w`` consecutive values (``len(values) - w + 1`` of them)."""
    out, total = [], sum(values[:w - 1])
    for i in range(w - 1, len(values)):
        total += values[i]
        out.append(total / w)
        total -= values[i - w + 1]
    return out


def _curves(run: Run, x_of: Callable[[dict[str, Any], int], float], xlabel: str) -> list[Panel]:
    train, evals = run.train, run.evals
    tx = [x_of(r, i) for i, r in enumerate(train)]
    ex = [x_of(r, -1) for r in evals]
    k = run.config.get("config", {}).get("tau_k") or "k"
    marker = "" if len(train) > 40 else "o"

    def series(label: str, xs: list[float], rows: list[dict[str, Any]], key: str, scale: float = 1.0,
               m: str = "o") -> list[Series]:
        pts = [(x, r[key] * scale) for x, r in zip(xs, rows) if isinstance(r.get(key), (int, float))]
        x, y = [x for x, _ in pts], [y for _, y in pts]
        if len(pts) <= SMOOTH_OVER:
            return [Series(label, x, y, marker=m)] if pts else []
        w = max(len(pts) // 40, 5)  # a running mean over about a fortieth of the run, the raw values beneath
        return [Series(f"{label}, each step", x, y, marker="", faint=True),
                Series(f"{label}, mean of {w} steps", x[w - 1:], _running_mean(y, w), marker="")]

    out = [Panel("loss", xlabel, "weighted soft cross-entropy",
                 series("train", tx, train, "loss", m=marker) + series("eval", ex, evals, "loss")),
           Panel(f"acceptance length tau@{k}", xlabel, "tokens per round",
                 series("train, simulated", tx, train, "sim_tau_k", m=marker)
                 + series("eval, simulated", ex, evals, "sim_tau_k") + series("eval, walked", ex, evals, "walk_tau_k")),
           Panel("throughput", xlabel, "tokens/s (the target's forward included)",
                 series("train", tx, train, "tokens_per_s", m=marker))]
    if any("mfu" in r for r in train):
        out.append(Panel("MFU", xlabel, "% of the bf16 peak", series("train", tx, train, "mfu", 100.0, marker)))
    return [p for p in out if p.series]


def _training(inputs: Inputs) -> list[str]:
    body = []
    for run in inputs.runs:
        clock = _clock(run)
        at_step = {r["step"]: t for r, t in zip(run.train, clock)}
        cfg = run.config.get("config", {})
        k = cfg.get("tau_k", "k")
        body.append(f"<h3>{_e(run.source.path)}</h3>")
        steps = [r["step"] for r in run.train]
        best = max(run.evals, key=lambda r: r.get("sim_tau_k", 0.0)) if run.evals else None
        last = run.evals[-1] if run.evals else None
        tps = [r["tokens_per_s"] for r in run.train if r.get("tokens_per_s")]
        mfu = [r["mfu"] for r in run.train if "mfu" in r]
        body.append(_table(
            ["target", "preset", "steps logged", "last step", "training time (s)", f"best simulated tau@{k}",
             "at step", f"last walked tau@{k}", "median tokens/s", "median MFU", "source"],
            [[run.config.get("target", "-"), run.config.get("preset") or ("custom" if run.config else "-"), len(steps),
              steps[-1] if steps else "-", _num(clock[-1] if clock else None, 0),
              _num(best.get("sim_tau_k") if best else None, 3), best["step"] if best else "-",
              _num(last.get("walk_tau_k") if last else None, 3), _num(statistics.median(tps) if tps else None, 0),
              f"{100 * statistics.median(mfu):.1f}%" if mfu else "-", run.source.cite()]]))
        by_step = _curves(run, lambda r, i: float(r["step"]), "optimizer step")
        if by_step:
            body.append(_figure(lambda p=by_step: plots.panels(p), "training curves against optimizer steps",
                                [run.source]))

        def seconds(r: dict[str, Any], i: int, clock=clock, at_step=at_step) -> float:
            if "train_s" in r:
                return float(r["train_s"])
            return clock[i] if i >= 0 else at_step.get(r["step"], float("nan"))

        by_time = _curves(run, seconds, "training time (s)")
        if by_time:
            body.append(_figure(lambda p=by_time: plots.panels(p), "training curves against training time",
                                [run.source]))
    return body


# --------------------------------------------------------------------------------------------
# Acceptance, speed, breakdown


def _label(r: dict[str, Any], src: Source) -> str:
    return f"{r['method']} k={r.get('k', '?')} b={r.get('batch_size', 1)} [{src.index}]"


def _acceptance(inputs: Inputs) -> list[str]:
    measured = [(r, s) for r, s in inputs.bench if r.get("accept_rate_per_pos")]
    simulated = [(run, run.evals[-1]) for run in inputs.runs if run.evals and run.evals[-1].get("per_step_acc")]
    if not measured and not simulated:
        return []
    series = [Series(_label(r, s), list(range(1, len(r["accept_rate_per_pos"]) + 1)), r["accept_rate_per_pos"])
              for r, s in measured]
    series += [Series(f"training eval, step {e['step']} (simulated) [{run.source.index}]",
                      list(range(1, len(e["per_step_acc"]) + 1)), e["per_step_acc"], linestyle="--")
               for run, e in simulated]
    panel = Panel("acceptance per draft position", "draft position", "acceptance rate", series)
    rows = [[_label(r, s), " ".join(f"{a:.3f}" for a in r["accept_rate_per_pos"]), _num(r.get("tau"), 3), s.cite()]
            for r, s in measured]
    rows += [[f"training eval, step {e['step']}", " ".join(f"{a:.3f}" for a in e["per_step_acc"]),
              _num(e.get("sim_tau"), 3), run.source.cite()] for run, e in simulated]
    sources = [s for _, s in measured] + [run.source for run, _ in simulated]
    return [_figure(lambda: plots.panels([panel], ncols=1), "acceptance rate at each draft position", sources),
            _table(["record", "acceptance per position", "tau", "source"], rows)]


def _best(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Per (method, batch), the row with the highest ``key``."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        at = (r["method"], int(r.get("batch", r.get("batch_size", 1))))
        if at not in out or r[key] > out[at][key]:
            out[at] = r
    return list(out.values())


def _speed_charts(inputs: Inputs, spec: list[tuple[dict[str, Any], Source]]) -> list[str]:
    """Speedup and tau against k (measured chains, predicted rows); against batch over several sizes."""
    speed = Panel("speedup against k", "draft tokens per step (k)", "speedup vs autoregressive", hline=1.0)
    tau = Panel("tokens per round against k", "draft tokens per step (k)", "tau (tokens per target forward)")
    groups: dict[tuple, list[tuple[dict[str, Any], Source]]] = {}
    for r, s in spec:
        groups.setdefault((r["method"], r.get("batch_size", 1)), []).append((r, s))
    for (method, b), items in sorted(groups.items()):
        items.sort(key=lambda x: x[0]["k"])
        label = f"{method} b={b}, measured"
        speed.series.append(Series(label, [r["k"] for r, _ in items], [r["speedup_vs_ar"] for r, _ in items]))
        tau.series.append(Series(label, [r["k"] for r, _ in items], [r["tau"] for r, _ in items]))
    for rows, src in inputs.plans:
        for method in sorted({r["method"] for r in rows}):
            for b in sorted({int(r["batch"]) for r in rows}):
                pts = sorted((r["k"], r["speedup"], r["expected_tokens"]) for r in rows
                             if r["method"] == method and int(r["batch"]) == b)
                label = f"{method} b={b}, predicted [{src.index}]"
                speed.series.append(Series(label, [p[0] for p in pts], [p[1] for p in pts], marker="x",
                                           linestyle="--"))
                tau.series.append(Series(label, [p[0] for p in pts], [p[2] for p in pts], marker="x", linestyle="--"))
    items = [speed, tau]
    batches = sorted({int(r.get("batch_size", 1)) for r, _ in spec} | {int(r["batch"]) for rows, _ in inputs.plans
                                                                       for r in rows})
    if len(batches) > 1:
        by_batch = Panel("speedup against batch (best k)", "batch size", "speedup vs autoregressive", logx=True,
                         hline=1.0, xticks=batches)
        for method in sorted({r["method"] for r, _ in spec}):
            best = sorted(_best([{**r, "batch": r.get("batch_size", 1)} for r, _ in spec if r["method"] == method],
                                "speedup_vs_ar"), key=lambda r: r["batch"])
            by_batch.series.append(Series(f"{method}, measured", [r["batch"] for r in best],
                                          [r["speedup_vs_ar"] for r in best]))
        for rows, src in inputs.plans:
            for method in sorted({r["method"] for r in rows}):
                best = sorted(_best([r for r in rows if r["method"] == method], "speedup"), key=lambda r: r["batch"])
                by_batch.series.append(Series(f"{method}, predicted [{src.index}]", [r["batch"] for r in best],
                                              [r["speedup"] for r in best], marker="x", linestyle="--"))
        items.append(by_batch)
    sources = [s for _, s in spec] + [s for _, s in inputs.plans]
    return [_figure(lambda: plots.panels(items), "speedup and tau against k" + (" and batch" if len(items) > 2 else ""),
                    sources)]


def _speed(inputs: Inputs) -> list[str]:
    spec = [(r, s) for r, s in inputs.bench if r.get("method") != "ar" and isinstance(r.get("k"), int)
            and all(isinstance(r.get(x), (int, float)) for x in ("speedup_vs_ar", "tau"))]  # chains: trees have no k
    body = _speed_charts(inputs, spec) if spec or inputs.plans else []
    if inputs.bench:
        body.append("<h3>Measured (bench records)</h3>")
        body.append(_table(
            ["method", "k", "batch", "prompts", "tau", "tokens/s", "AR tokens/s", "speedup", "decode speedup",
             "lossless (verdict)", "dtype", "source"],
            [[r["method"], r.get("k", "-"), r.get("batch_size", 1), r.get("num_prompts", "-"), _num(r.get("tau"), 3),
              _num(r.get("tokens_per_s"), 1), _num(r.get("ar_tokens_per_s"), 1), _num(r.get("speedup_vs_ar"), 3),
              _num(r.get("decode_speedup_vs_ar"), 3), r.get("verdict") or _num(r.get("lossless")), r.get("dtype", "-"),
              s.cite()]
             for r, s in inputs.bench], left=1))
    for rows, src in inputs.plans:
        body.append(f"<h3>Predicted: best k per method and batch ({_e(src.path)})</h3>")
        body.append(_table(["method", "batch", "k", "E[tokens]", "tokens/s", "AR tokens/s", "speedup", "source"],
                           [[r["method"], r["batch"], r["k"], _num(r.get("expected_tokens"), 3),
                             _num(r.get("tokens_per_s"), 0), _num(r.get("ar_tokens_per_s"), 0),
                             _num(r["speedup"], 3), src.cite()]
                            for r in sorted(_best(rows, "speedup"), key=lambda r: (r["batch"], r["method"]))]))
    return body


def _served(inputs: Inputs) -> list[str]:
    """``bench --server`` records: tokens/s, TTFT and ITL against concurrency, a line per role
    (server, baseline), engine and method; served tau where the engine counts acceptance."""
    if not inputs.served:
        return []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r, s in inputs.served:  # a line per file, role, engine and method
        if isinstance(r.get("concurrency"), int):
            groups.setdefault((s.index, r.get("role", "server"), r.get("engine", "?"), r["method"]), []).append(r)
    items = [Panel("throughput", "concurrency", "tokens/s (all requests)", logx=True),
             Panel("time to first token", "concurrency", "ms", logx=True),
             Panel("inter-token latency", "concurrency", "ms", logx=True)]
    for (index, role, engine, method), rows in sorted(groups.items()):
        rows.sort(key=lambda r: r["concurrency"])
        c = [r["concurrency"] for r in rows]
        name = f"{role} ({engine}, {method}) [{index}]"
        keyed = (("tokens_per_s",), ("ttft_ms_p50", "ttft_ms_p99"), ("itl_ms_p50", "itl_ms_p99"))
        for panel, keys in zip(items, keyed):
            for key in keys:
                pts = [(x, r[key]) for x, r in zip(c, rows) if isinstance(r.get(key), (int, float))]
                if pts:
                    label = name + ("" if len(keys) == 1 else f" {key.rsplit('_', 1)[1]}")
                    panel.series.append(Series(label, [x for x, _ in pts], [y for _, y in pts],
                                               linestyle="-" if key.endswith(("p50", "_s")) else "--"))
    items = [p for p in items if p.series]
    for p in items:
        p.xticks = sorted({x for s in p.series for x in s.x})
    body = [_figure(lambda: plots.panels(items, ncols=3), "served throughput and latency against concurrency",
                    [s for _, s in inputs.served])] if items else []
    body.append(_table(
        ["role", "engine", "method", "concurrency", "completed", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
         "ITL p50 ms", "ITL p99 ms", "served tau", "source"],
        [[r.get("role", "server"), f"{r.get('engine', '?')} {r.get('engine_version') or ''}".strip(), r["method"],
          r.get("concurrency", "-"), f"{r.get('completed', '-')}/{r.get('num_prompts', '-')}",
          _num(r.get("tokens_per_s"), 1), _num(r.get("ttft_ms_p50"), 0), _num(r.get("ttft_ms_p99"), 0),
          _num(r.get("itl_ms_p50"), 1), _num(r.get("itl_ms_p99"), 1),
          _num(r.get("tau"), 3) if r.get("tau") is not None else "no acceptance counters", s.cite()]
         for r, s in inputs.served], left=3))
    return body


def _breakdown(inputs: Inputs) -> list[str]:
    """Measured rounds (bench: draft and verify) and predicted ones (plan: the draft round and the
    verify step's named terms, collectives among them), each against the plain steps that would
    yield the same tokens; apart, as a CPU's milliseconds and a predicted GPU's do not share a scale."""
    measured = [(r, s) for r, s in inputs.bench if r.get("method") != "ar"
                and all(isinstance(r.get(x), (int, float)) for x in ("verify_step_ms", "draft_step_ms", "ar_step_ms",
                                                                      "tau"))]
    predicted = [(r, s) for rows, s in inputs.plans for r in sorted(_best(rows, "speedup"),
                                                                     key=lambda r: (r["batch"], r["method"]))]
    body = []
    marks_name = "AR steps for the same tokens (break-even)"
    if measured:
        labels = [_label(r, s) for r, s in measured]
        stacks = {"draft": [r["draft_step_ms"] for r, _ in measured],
                  "verify": [r["verify_step_ms"] for r, _ in measured]}
        marks = {"one AR step": [r["ar_step_ms"] for r, _ in measured],
                 marks_name: [r["ar_step_ms"] * r["tau"] for r, _ in measured]}
        body.append(_figure(lambda: plots.stacked_bars(labels, stacks, "ms per round", "measured rounds", marks),
                            "measured: a round's drafting and verification against plain steps",
                            [s for _, s in measured]))
    if predicted:
        labels = [f"{r['method']} k={r['k']} b={r['batch']} [{s.index}]" for r, s in predicted]
        names = sorted({n for r, _ in predicted for n in (r.get("verify_terms_ms") or {})})
        stacks = {"draft round": [r.get("draft_round_ms", 0.0) for r, _ in predicted]}
        for n in names or ["verify"]:
            stacks[f"verify: {n}"] = [(r.get("verify_terms_ms") or {}).get(n, 0.0) if names else r["verify_step_ms"]
                                      for r, _ in predicted]
        stacks = {n: v for n, v in stacks.items() if any(v)}
        marks = {"one AR step": [r["ar_step_ms"] for r, _ in predicted],
                 marks_name: [r["ar_step_ms"] * r["expected_tokens"] for r, _ in predicted]}
        body.append(_figure(lambda: plots.stacked_bars(labels, stacks, "ms per round", "predicted rounds (best k)",
                                                       marks),
                            "predicted: the draft round and the verify step's terms against plain steps",
                            [s for _, s in predicted]))
    rows = [[_label(r, s), _num(r["draft_step_ms"], 3), _num(r["verify_step_ms"], 3), _num(r["ar_step_ms"], 3),
             _num(r["verify_step_ms"] / r["ar_step_ms"], 2), "measured", s.cite()] for r, s in measured]
    rows += [[f"{r['method']} k={r['k']} b={r['batch']}", _num(r.get("draft_round_ms"), 3),
              _num(r["verify_step_ms"], 3), _num(r["ar_step_ms"], 3), _num(r.get("verify_cost_ratio"), 2),
              "predicted: " + ", ".join(f"{t['term']} {100 * t['share']:.0f}%" for t in r.get("dominant_terms", [])),
              s.cite()] for r, s in predicted]
    if rows:
        body.append(_table(["record", "draft ms", "verify ms", "AR step ms", "verify / AR", "largest terms", "source"],
                           rows))
    return body


# --------------------------------------------------------------------------------------------
# Training plan, sources, the page


def _train_plan(inputs: Inputs) -> list[str]:
    body = []
    for plan, src in inputs.train_plans:
        stages = plan["stages"]
        body.append(f"<h3>{_e(plan.get('target', '?'))} on {_e(plan.get('gpus', '?'))} x "
                    f"{_e(plan.get('hardware', '?'))} ({_e(src.path)})</h3>")
        rows = [[s["stage"], s.get("mode", "-"), s.get("gpus", "-"), s.get("hardware", "-"),
                 _num(s["time_s"] / 3600, 2), _num(s.get("gpu_hours"), 2), _num(s.get("memory_gb_per_gpu"), 1),
                 _num(s.get("disk_gb"), 2), src.cite()] for s in stages]
        total = plan.get("total", {})
        rows.append(["total", "", "", "", _num(total.get("time_s", 0) / 3600, 2), _num(total.get("gpu_hours"), 2), "",
                     _num(total.get("disk_gb"), 2), src.cite()])
        body.append(_table(["stage", "mode", "GPUs", "hardware", "time (h)", "GPU-hours", "memory GB/GPU", "disk GB",
                            "source"], rows, left=4))
        tau = plan.get("tau") or {}
        panels_ = []
        body.append(_figure(lambda st=stages: plots.stacked_bars(
            [x["stage"] for x in st], {"time": [x["time_s"] / 3600 for x in st]}, "hours", "time per stage"),
            "the training plan's time per stage", [src]))
        if tau:
            central, low, high = tau["central"], tau["low"], tau["high"]
            tokens = (plan.get("sizes") or {}).get("train_tokens")
            pts = tau.get("points") or []
            tau_panel = Panel(f"expected tau@{tau.get('k', 5)} against training tokens", "training tokens (M)",
                              "tau", [Series("measured heads", [p["tokens"] / 1e6 for p in pts],
                                             [p["tau"] for p in pts], linestyle="")])
            if tokens:
                tau_panel.series.append(Series("this plan (range)", [tokens / 1e6], [central],
                                               yerr=[[central - low], [high - central]], marker="s", linestyle=""))
            panels_.append(tau_panel)
            at = tau.get("at_k") or {}
            body.append(_table(["k", "expected tau", "low", "high", "fit", "source"],
                               [[tau.get("k", 5), _num(central, 2), _num(low, 2), _num(high, 2), tau.get("fit", "-"),
                                 src.cite()]]
                               + ([[at["k"], _num(at["central"], 2), _num(at["low"], 2), _num(at["high"], 2),
                                    "same fit", src.cite()]] if at else [])))
        if panels_:
            body.append(_figure(lambda p=panels_: plots.panels(p, ncols=1), "the expected tau and its range, with the "
                                "measured heads its fit rests on", [src]))
    return body


def _sources(inputs: Inputs) -> list[str]:
    rows = [[f"[{s.index}]", s.kind, s.path, s.device or "not recorded",
             (s.date or "?") + (" (file date)" if s.date_from_file else ""), s.commit or "not recorded"]
            for s in inputs.sources]
    return [_table(["#", "kind", "file", "device", "date", "commit"], rows, left=6)]


def render(inputs: Inputs) -> str:
    built = [(key, part(inputs)) for key, part in (("training", _training), ("acceptance", _acceptance),
                                                   ("speed", _speed), ("served", _served),
                                                   ("breakdown", _breakdown),
                                                   ("train-plan", _train_plan), ("sources", _sources))]
    built = [(key, body) for key, body in built if body]
    nav = " ".join(f'<a href="#{key}">{_e(SECTIONS[key])}</a>' for key, _ in built)
    notes = "".join(f'<p class="note">{_e(n)}</p>' for n in inputs.notes)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta name="generator" content="{GENERATOR}"><title>outrider report</title>'
            f"<style>{STYLE}</style></head><body>\n<h1>outrider report</h1>\n"
            f"<p class=\"cite\">written {today()} from {len(inputs.sources)} source(s); [n] numbers the sources "
            f"table at the end: device · date · commit.</p>\n<nav>{nav}</nav>\n{notes}\n"
            + "\n".join(_section(key, body) for key, body in built) + "\n</body></html>\n")


def write_report(paths: Sequence[str], out: str | Path) -> list[str]:
    """Load ``paths``, write the page to ``out`` atomically; the notes shown on the page."""
    inputs = load(list(paths))
    if not plots.available():
        inputs.notes.append(f"charts are left out: {plots.INSTALL}")
    atomic_write_text(out, render(inputs))
    return inputs.notes
