"""A training plan as Markdown, as JSON, and on the console.

Contract: ``render_markdown(plan)`` returns the whole plan as Markdown: sizes, a summary table
(time, GPU-hours, peak memory per GPU, disk per stage and in total), the expected acceptance
with its range and fit, each stage's figures with their formulas and sources, and every rate
used with its kind (measured / estimate, not measured / formula) and source. ``to_json(plan)``
gives the same numbers as a JSON-ready dict; ``print_plan`` prints the summary and the formulas;
``report`` prints and writes both files.

Not done here: computing anything (``train_plan``)."""

from __future__ import annotations

from typing import Any

from outrider.fsutil import atomic_write_text, write_json_output
from outrider.plan import rates as R
from outrider.plan.train_plan import Figure, Stage, TrainPlan
from outrider.provenance import git_commit, today

PUBLISHED_K25 = ("published EAGLE-3 heads for Kimi-K2.5 reach an acceptance length of about 2.7-3.3 at k = 3 "
                 "(huggingface.co/lightseekorg/kimi-k2.5-eagle3, lightseekorg/kimi-k2.5-eagle3-mla, "
                 "AQ-MedAI/Kimi-K25-eagle3 through sgl-project/sglang PR 19689)")


def _dur(seconds: float) -> str:
    if seconds <= 0:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _gb(v: float) -> str:
    return "-" if v <= 0 else (f"{v:,.1f} GB" if v < 1000 else f"{v / 1000:,.2f} TB")


def _sources(fig: Figure, rates: dict[str, R.Rate]) -> str:
    out = []
    for s in fig.sources:
        r = rates.get(s)
        out.append(f"`{s}` ({r.label})" if r is not None else s)
    return "; ".join(out) or "formula"


def _sizes(plan: TrainPlan) -> str:
    s = plan.sizes
    return (f"{s.conversations:,} conversations x {s.turns} turn(s) x {s.tokens_per_turn:,} tokens, examples cut at "
            f"{s.max_length:,}: S = {s.distinct_tokens:,.0f} distinct tokens, G = {s.generated_tokens:,.0f} "
            f"regenerated (reply share {s.reply_share:.2f}), N = S x {s.epochs:g} epochs = {s.train_tokens:,.0f} "
            f"training tokens")


def _tau_lines(plan: TrainPlan) -> list[str]:
    t = plan.tau
    c, lo, hi = plan.tau_at_k
    lines = [f"Expected held-out tau@5 after N = {t.tokens / 1e6:,.1f} M training tokens: **{t.text()}**"]
    if plan.tau_k != 5:
        lines.append(f"At k = {plan.tau_k}: {c:.2f} (range {lo:.2f}-{hi:.2f}), through our measured per-position "
                     f"profile ({R.ROW_SPREAD_SOURCE}) scaled to each tau@5.")
    lines.append(f"Fit: {plan.curve.formula()}; range: the near-optimal and leave-one-record-out fits, +/- 2 "
                 f"residual sd. Data: {R.CURVE_NOTE}.")
    if plan.target != "SmolLM2-135M":
        lines.append(f"For {plan.target} the curve gives the shape, not the level: {PUBLISHED_K25}.")
    return lines


def render_markdown(plan: TrainPlan) -> str:
    hw = plan.hardware
    out = [f"# Training plan: an EAGLE-3 head for {plan.target} on {plan.gpus} x {hw.name}", "",
           _sizes(plan) + ".", ""]
    if plan.calibration:
        out += [f"Served stages use the {plan.calibration}.", ""]
    out += ["## Summary", "", "| stage | mode | GPUs | time | GPU-hours | peak memory per GPU | disk |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in plan.stages:
        out.append(f"| {s.name} | {s.mode} | {s.gpus or '-'} | {_dur(s.time.value)} | "
                   f"{s.gpu_hours.value:,.2f} | {_gb(s.memory.value)} | {_gb(s.disk.value)} |")
    peak = max(s.memory.value for s in plan.stages)
    out += [f"| **total** | | | **{_dur(plan.total_s)}** | **{plan.total_gpu_hours:,.2f}** | {_gb(peak)} (largest) | "
            f"**{_gb(plan.disk_gb)}** |", "", "## Expected acceptance", ""]
    out += [line + "  " for line in _tau_lines(plan)]
    out += ["", "## Stages", ""]
    for s in plan.stages:
        out += [f"### {s.name} ({s.mode})", "", "| figure | value | formula | source |", "| --- | --- | --- | --- |"]
        for label, fig, text in (("time", s.time, _dur(s.time.value)), ("GPU-hours", s.gpu_hours,
                                                                          f"{s.gpu_hours.value:,.2f}"),
                                 ("peak memory per GPU", s.memory, _gb(s.memory.value)), ("disk", s.disk, _gb(s.disk.value))):
            out.append(f"| {label} | {text} | {fig.formula} | {_sources(fig, plan.rates)} |")
        out += [f"- {n}" for n in s.notes] + [""]
    used = sorted({n for s in plan.stages for f in (s.time, s.memory, s.disk) for n in f.sources if n in plan.rates}
                  | {"reply_share"})
    out += ["## Rates used", "", "| rate | value | unit | kind | source |", "| --- | --- | --- | --- | --- |"]
    for n in used:
        r = plan.rates[n]
        out.append(f"| `{n}` | {r.value:,.4g} | {r.unit} | {r.label} | {r.source} |")
    out += ["", f"Hardware: {hw.description}; {hw.source}", ""]
    if plan.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in plan.notes] + [""]
    return "\n".join(out)


def _stage_json(s: Stage) -> dict[str, Any]:
    return {"stage": s.name, "mode": s.mode, "gpus": s.gpus, "hardware": s.hardware, "time_s": s.time.value,
            "gpu_hours": s.gpu_hours.value, "memory_gb_per_gpu": s.memory.value, "disk_gb": s.disk.value,
            "formulas": {"time": s.time.formula, "memory": s.memory.formula, "disk": s.disk.formula},
            "sources": sorted({x for f in (s.time, s.memory, s.disk) for x in f.sources}), "notes": s.notes}


def to_json(plan: TrainPlan) -> dict[str, Any]:
    s, t = plan.sizes, plan.tau
    return {
        "target": plan.target, "hardware": plan.hardware.name, "gpus": plan.gpus, "date": today(),
        "git_commit": git_commit(),
        "sizes": {"conversations": s.conversations, "turns": s.turns, "tokens_per_turn": s.tokens_per_turn,
                  "epochs": s.epochs, "max_length": s.max_length, "reply_share": s.reply_share,
                  "distinct_tokens": s.distinct_tokens, "generated_tokens": s.generated_tokens,
                  "train_tokens": s.train_tokens},
        "stages": [_stage_json(x) for x in plan.stages],
        "total": {"time_s": plan.total_s, "gpu_hours": plan.total_gpu_hours, "disk_gb": plan.disk_gb},
        "tau": {"k": 5, "central": t.central, "low": t.low, "high": t.high, "extrapolated": t.extrapolated,
                "at_k": {"k": plan.tau_k, "central": plan.tau_at_k[0], "low": plan.tau_at_k[1],
                         "high": plan.tau_at_k[2]},
                "fit": plan.curve.formula(),
                "points": [{"tokens": p.tokens, "tau": p.tau, "source": p.source} for p in plan.curve.points]},
        "rates": {n: {"value": r.value, "unit": r.unit, "kind": r.kind, "source": r.source}
                  for n, r in plan.rates.items()},
        "calibration": plan.calibration, "notes": plan.notes,
    }


def report(plan: TrainPlan, console, markdown_path: str | None = None, json_path: str | None = None) -> None:
    """Print the plan; write its Markdown and its JSON where asked (atomically)."""
    if json_path != "-":
        print_plan(plan, console)
    if markdown_path:
        atomic_write_text(markdown_path, render_markdown(plan))
        console.print(f"plan written to {markdown_path}")
    if json_path:
        write_json_output(json_path, to_json(plan))


def print_plan(plan: TrainPlan, console) -> None:
    from rich.table import Table

    console.print(f"[bold]Training plan: an EAGLE-3 head for {plan.target} on {plan.gpus} x {plan.hardware.name}[/bold]")
    console.print(_sizes(plan))
    table = Table(title_justify="left")
    for col in ("stage", "mode", "GPUs", "time", "GPU-h", "memory/GPU", "disk"):
        table.add_column(col, justify="left" if col in ("stage", "mode") else "right")
    for s in plan.stages:
        table.add_row(s.name, s.mode, str(s.gpus or "-"), _dur(s.time.value), f"{s.gpu_hours.value:,.2f}",
                      _gb(s.memory.value), _gb(s.disk.value))
    table.add_row("total", "", "", _dur(plan.total_s), f"{plan.total_gpu_hours:,.2f}", "", _gb(plan.disk_gb))
    console.print(table)
    for line in _tau_lines(plan):
        console.print(line.replace("**", ""))
    for s in plan.stages:
        console.print(f"[bold]{s.name}[/bold] time: {s.time.formula}", highlight=False)
        console.print(f"  memory: {s.memory.formula}", highlight=False)
        for n in s.notes:
            console.print(f"  note: {n}", highlight=False)
    estimates = sorted({n for s in plan.stages for f in (s.time, s.memory, s.disk) for n in f.sources
                        if n in plan.rates and plan.rates[n].kind == "estimate"})
    if estimates:
        console.print(f"estimates, not measured: {', '.join(estimates)}")
    for n in plan.notes:
        console.print(f"note: {n}", highlight=False)
