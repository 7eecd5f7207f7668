"""A run's metrics log: ``metrics.jsonl``, and the same scalars where the ecosystem looks for them.

Contract: ``open_run`` writes a new run's ``train_config.json`` (with its date and commit) and
empty ``metrics.jsonl``, or cuts a resumed run's log at its step, and returns the ``MetricsLog``.
``MetricsLog(run_dir, report_to)`` appends each record to ``metrics.jsonl`` (through
``checkpoint.append_metric``) and, with ``report_to`` ``tensorboard`` or ``wandb`` (as Hugging
Face's Trainer spells it; ``none``: the file only), logs its scalars there too at the record's
``step``: every number under ``{type}/{key}`` (a list as ``{type}/{key}/{i}``, ``i`` from 0);
booleans and strings are not scalars and stay in the file. TensorBoard's event files go to
``run_dir/tensorboard``; a resumed run purges the events after its checkpoint's step, as
``metrics.jsonl`` is cut there. ``require(report_to)`` checks that the package is installed
before any work starts: a missing one is a one-line ``UserError``. Neither package is a
dependency of outrider.

Not done here: what the records hold (``trainer``, ``metrics``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outrider.errors import UserError
from outrider.fsutil import atomic_write_json, atomic_write_text
from outrider.provenance import git_commit, today
from outrider.train.loop import checkpoint

REPORT_TO = ("none", "tensorboard", "wandb")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def require(report_to: str) -> None:
    """One line (``UserError``) when ``report_to`` is unknown or its package is not installed."""
    if report_to not in REPORT_TO:
        raise UserError(f"--report-to {report_to}: use one of {', '.join(REPORT_TO)}")
    if report_to == "none":
        return
    try:
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (needs the tensorboard package)
        else:
            import wandb  # noqa: F401
    except ImportError:
        raise UserError(f"--report-to {report_to} needs the {PACKAGES[report_to]} package, which is not installed: "
                        f"pip install {PACKAGES[report_to]} (or --report-to none)") from None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's numbers as ``{type}/{key}`` scalars (lists indexed), the step excluded."""
    kind = record.get("type", "metrics")
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("type", "step") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[f"{kind}/{key}"] = float(value)
        elif isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            out.update({f"{kind}/{key}/{i}": float(v) for i, v in enumerate(value)})
    return out


class MetricsLog:
    """``metrics.jsonl`` plus the chosen tracker; ``resumed_step``: the checkpoint's step (None: a new run)."""

    def __init__(self, run_dir: str | Path, report_to: str = "none", resumed_step: int | None = None,
                 config: dict[str, Any] | None = None):
        require(report_to)
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.report_to = report_to
        self.writer: Any = None
        self.wandb: Any = None
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resumed_step is None else resumed_step + 1
            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge)
        elif report_to == "wandb":
            import wandb

            self.wandb = wandb.init(project="outrider", name=self.run_dir.name, dir=str(self.run_dir),
                                    config=config or {}, resume="allow")

    def write(self, record: dict[str, Any]) -> None:
        checkpoint.append_metric(self.path, record)
        step = int(record.get("step", 0))
        values = scalars(record)
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, global_step=step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def open_run(run_dir: str | Path, report_to: str, resumed_step: int | None, settings: dict[str, Any]) -> MetricsLog:
    """The log of a run starting (``resumed_step`` None: ``train_config.json`` written from
    ``settings`` plus the date and commit, ``metrics.jsonl`` emptied) or resumed (``metrics.jsonl``
    cut at its checkpoint's step, as a killed run may have logged past it)."""
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    if resumed_step is None:
        atomic_write_json(out / "train_config.json", {**settings, "date": today(), "git_commit": git_commit()})
        atomic_write_text(out / "metrics.jsonl", "")
    else:
        checkpoint.cut_metrics(out / "metrics.jsonl", resumed_step)
    return MetricsLog(out, report_to, resumed_step, settings.get("config"))
