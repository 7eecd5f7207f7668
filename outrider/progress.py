"""The one progress bar: rich, on stderr, and nothing at all when switched off.

``Bar(enabled, description, total)`` is a context manager; ``advance(n)`` moves it on,
``update(completed=..., **fields)`` sets it and the values of its ``fields`` template (extra text
columns such as ``"loss {loss} {tps} tok/s"``), ``log(text)`` prints a line above it, ``close()`` ends it (as leaving the context does). ``total=None``
draws a spinner (work of unknown length); ``unit="bytes"`` shows the size instead of a count.
Disabled, it prints nothing and costs nothing, so callers pass their ``progress`` flag straight
through instead of branching. ``manual=True`` draws only inside ``advance``/``update`` (no refresh
thread), for timed work: a benchmark keeps the drawing out of its clocks. ``transformers_bars(on)``
keeps transformers' own bars (its "Loading weights") off while ``on`` is false, and restores the
setting it found.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator


@contextlib.contextmanager
def transformers_bars(on: bool) -> Iterator[None]:
    """transformers' progress bars as they are when ``on``; off inside the block when not, then back
    to what they were (an environment that turned them off keeps them off)."""
    if on:
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class Bar:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, description: str, total: int | None, manual: bool = False,
                 completed: int = 0, fields: str = "", unit: str = "count"):
        self._progress = None
        self._manual = manual
        if not enabled or (total is not None and total <= 0):
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = [SpinnerColumn(finished_text="[green]done")] if total is None else []
        columns += [TextColumn("{task.description}"), BarColumn()]
        if unit == "bytes":
            columns.append(TextColumn(f"{total / 1e6:,.0f} MB" if total else ""))
        elif total is not None:
            columns.append(MofNCompleteColumn())
        if fields:
            columns.append(TextColumn(re.sub(r"\{(\w+)\}", r"{task.fields[\1]}", fields)))
        columns.append(TimeElapsedColumn())
        if total is not None:
            columns.append(TimeRemainingColumn())
        self._progress = Progress(*columns, console=Console(stderr=True), auto_refresh=not manual)
        self._progress.start()
        names = re.findall(r"\{(\w+)\}", fields)
        self._total = total
        self._task = self._progress.add_task(description, total=total, completed=completed,
                                             **{n: "-" for n in names})

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)
            if self._manual:
                self._progress.refresh()

    def update(self, completed: int | None = None, **fields) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, **fields)
            if self._manual:
                self._progress.refresh()

    def log(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._progress is not None:
            if self._total is None:  # a spinner: shown finished
                self._progress.update(self._task, total=1, completed=1)
            self._progress.stop()
            self._progress = None
