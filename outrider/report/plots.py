"""The one plotting module: every chart outrider draws (``plan --plot``'s PNGs, the report's SVGs).

Contract: charts are described as plain data (``Series`` in ``Panel``s, or stacked bars) and
rendered by matplotlib (Agg, no display) into bytes: ``svg`` (glyphs as paths, so the page needs
no font and no network) or ``png``. ``plan_pngs(rows, where, out_dir)`` draws a plan's rows (the
JSON ``plan --json`` writes) as PNG files, written atomically. matplotlib is an optional
dependency: ``available()`` says whether it is installed, and ``MissingPlotting`` (a
``UserError``) is raised by a drawing call when it is not. Nothing here reads files or computes a
figure's numbers: callers pass the values they show.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from outrider.errors import UserError
from outrider.fsutil import atomic_write_bytes

INSTALL = "pip install matplotlib (or outrider[report])"


class MissingPlotting(UserError):
    """matplotlib is not installed."""


@dataclass
class Series:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    marker: str = "o"
    linestyle: str = "-"
    yerr: Sequence[Sequence[float]] | None = None  # [lower offsets, upper offsets], as matplotlib takes them
    faint: bool = False  # drawn thin and pale (raw values under their running mean)


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    logx: bool = False
    hline: float | None = None  # a grey dashed reference (1.0: no speedup)
    xticks: Sequence[float] | None = None


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingPlotting(f"charts need matplotlib, which is not installed: {INSTALL}") from None
    plt.rcParams.update({"svg.fonttype": "path", "svg.hashsalt": "outrider", "font.size": 9})
    return plt


def _render(plt, fig, fmt: str) -> bytes:
    buf = io.BytesIO()
    metadata = {"Date": None} if fmt == "svg" else {}
    fig.savefig(buf, format=fmt, dpi=110, bbox_inches="tight", metadata=metadata)
    plt.close(fig)
    return buf.getvalue()


def panels(items: Sequence[Panel], fmt: str = "svg", ncols: int = 2, title: str | None = None) -> bytes:
    """Line charts, one per panel, in a grid of ``ncols`` columns."""
    plt = _pyplot()
    ncols = max(1, min(ncols, len(items)))
    nrows = -(-len(items) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax, p in zip(axes.flat, items):
        for s in p.series:
            if s.yerr is not None:
                ax.errorbar(s.x, s.y, yerr=s.yerr, marker=s.marker, linestyle=s.linestyle, label=s.label, capsize=4)
            elif s.faint:
                ax.plot(s.x, s.y, linestyle=s.linestyle, label=s.label, linewidth=0.6, alpha=0.35)
            else:
                ax.plot(s.x, s.y, marker=s.marker, linestyle=s.linestyle, label=s.label,
                        markersize=3 if len(s.x) > 30 else 5)
        if p.hline is not None:
            ax.axhline(p.hline, color="grey", linestyle="--", linewidth=1)
        if p.logx:
            ax.set_xscale("log", base=2)
        if p.xticks is not None:
            ax.set_xticks(list(p.xticks), [f"{t:g}" for t in p.xticks])
        ax.set(title=p.title, xlabel=p.xlabel, ylabel=p.ylabel)
        ax.grid(alpha=0.3)
        if any(s.label for s in p.series):
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(items):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _render(plt, fig, fmt)


def stacked_bars(labels: Sequence[str], stacks: dict[str, Sequence[float]], ylabel: str, title: str,
                 marks: dict[str, Sequence[float | None]] | None = None, fmt: str = "svg") -> bytes:
    """One bar per label, stacked from ``stacks`` (name -> a value per label); ``marks``: named
    reference values drawn as short black ticks on the bars (None: none for that bar)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(labels) + 2.5), 3.6))
    xs = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for name, values in stacks.items():
        ax.bar(xs, values, bottom=bottom, label=name, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, (name, values) in enumerate((marks or {}).items()):
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        ax.scatter([x for x, _ in pts], [v for _, v in pts], marker="_", s=900, color="black" if i == 0 else "red",
                   label=name, zorder=3)
    ax.set_xticks(xs, labels, rotation=20, ha="right")
    ax.set(ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _render(plt, fig, fmt)


def plan_panels(rows: Sequence[dict[str, Any]], where: str) -> list[Panel]:
    """A plan's predictions as charts: speedup against k (one panel per batch size, a line per
    method) and, over several batch sizes, speedup against batch (each method at its best k)."""
    methods = sorted({r["method"] for r in rows})
    batches = sorted({int(r["batch"]) for r in rows})
    out = []
    for b in batches:
        p = Panel(f"{where}, batch {b}", "draft tokens per step (k)", "predicted speedup vs autoregressive",
                  hline=1.0)
        for m in methods:
            pts = sorted((r["k"], r["speedup"]) for r in rows if int(r["batch"]) == b and r["method"] == m)
            if pts:
                p.series.append(Series(m, [k for k, _ in pts], [s for _, s in pts]))
        out.append(p)
    if len(batches) > 1:
        p = Panel(where, "batch size", "predicted speedup vs autoregressive", logx=True, hline=1.0, xticks=batches)
        for m in methods:
            best = [(b, max(r["speedup"] for r in rows if int(r["batch"]) == b and r["method"] == m))
                    for b in batches if any(int(r["batch"]) == b and r["method"] == m for r in rows)]
            p.series.append(Series(f"{m} (best k)", [b for b, _ in best], [s for _, s in best]))
        out.append(p)
    return out


def plan_pngs(rows: Sequence[dict[str, Any]], where: str, out_dir: str | Path) -> list[Path]:
    """``plan --plot``: ``speedup_vs_k_batch{B}.png`` per batch size and ``speedup_vs_batch.png``,
    written atomically into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batches = sorted({int(r["batch"]) for r in rows})
    names = [f"speedup_vs_k_batch{b}.png" for b in batches] + (["speedup_vs_batch.png"] if len(batches) > 1 else [])
    written = []
    for name, panel in zip(names, plan_panels(rows, where)):
        written.append(atomic_write_bytes(out / name, panels([panel], fmt="png", ncols=1)))
    return written
