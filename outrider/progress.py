"""A rich progress bar on stderr that can be switched off.

``Bar(enabled, description, total)`` is a context manager; ``advance(n)`` moves it on. Disabled,
or with nothing to count (``total <= 0``), it prints nothing and costs nothing, so callers pass
their ``progress`` flag straight through instead of branching. ``manual=True`` draws only inside
``advance`` (no refresh thread), for timed work: a benchmark keeps the drawing out of its clocks.
"""

from __future__ import annotations


class Bar:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, description: str, total: int, manual: bool = False):
        self._progress = None
        self._manual = manual
        if enabled and total > 0:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), console=Console(stderr=True), auto_refresh=not manual)
            self._progress.start()
            self._task = self._progress.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)
            if self._manual:
                self._progress.refresh()

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
