"""PNG plots of a plan: speedup vs k (one line per method, one figure per batch size) and
speedup vs batch size (each method at its best k).

Contract: ``plot_plan(result, out_dir)`` writes the PNGs atomically and returns their paths,
or returns ``None`` when matplotlib is not installed (it is an optional dependency; the caller
prints a one-line note). Nothing here computes predictions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outrider.fsutil import atomic_path


def plot_plan(result: Any, out_dir: str | Path) -> list[Path] | None:
    """PNG plots of a ``planner.PlanResult`` into ``out_dir``; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    preds = result.predictions
    methods = sorted({p.method for p in preds})
    batches = sorted({p.batch for p in preds})
    where = f"{result.target} on {result.tp} x {result.hardware.name}"

    def save(fig, name: str) -> None:
        path = out / name
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    for b in batches:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in methods:
            pts = sorted((p.k, p.speedup) for p in preds if p.batch == b and p.method == m)
            ax.plot([k for k, _ in pts], [s for _, s in pts], marker="o", label=m)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="draft tokens per step (k)", ylabel="predicted speedup vs autoregressive",
               title=f"{where}, batch {b}")
        ax.legend()
        save(fig, f"speedup_vs_k_batch{b}.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        best = [max((p for p in preds if p.batch == b and p.method == m), key=lambda p: p.speedup) for b in batches]
        ax.plot(batches, [p.speedup for p in best], marker="o", label=f"{m} (best k)")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    if len(batches) > 1:
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
    ax.set(xlabel="batch size", ylabel="predicted speedup vs autoregressive", title=where)
    ax.legend()
    save(fig, "speedup_vs_batch.png")
    return written
