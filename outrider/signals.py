"""SIGINT and SIGTERM while a verb runs: stop cleanly, keep what was written, say so in one line.

Contract: ``Signals`` (a context manager, entered once by the CLI around a verb) turns SIGINT and
SIGTERM into ``Interrupted``, a ``KeyboardInterrupt`` that knows its signal and exit status
(130 for SIGINT, 143 for SIGTERM, as a shell reports them). Raised where the main thread is, it
unwinds the verb like Ctrl-C: temporaries are removed, finished shards and conversations stay
(every one was written whole under its final name). Inside ``deferred()`` (a training loop) the
first signal is only recorded (``received``): the loop finishes the step it is in, writes its
checkpoint and raises ``Interrupted`` itself; a second signal raises at once. Outside the CLI
(the Python API) nothing is installed and Ctrl-C is Python's own ``KeyboardInterrupt``.
``exit_process(code)`` ends the CLI's process; a rank of a torchrun group (``WORLD_SIZE`` > 1) runs
its exit handlers, flushes its output and leaves without the interpreter's teardown, where the
destructors of gloo's threads aborted a rank whose work was done (SIGABRT in about one run in 20).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The verb was stopped by ``signum``; ``detail`` says what was kept (for the one line)."""

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.detail = signum, detail

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class Signals:
    """SIGINT/SIGTERM handlers for the duration of a ``with`` block (main thread only)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._deferring = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may install handlers; elsewhere Python's own behaviour stays
        for s in HANDLED:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self._deferring and self.received is None:
            self.received = signum  # the loop stops at its next step boundary
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[Signals]:
        """Record the first signal instead of raising it while the block runs."""
        self._deferring += 1
        try:
            yield self
        finally:
            self._deferring -= 1


def exit_process(code: int) -> None:
    """``sys.exit(code)``; a torchrun rank: exit handlers, flushed output, then ``os._exit(code)``."""
    if os.environ.get("WORLD_SIZE", "1").strip() in ("", "0", "1"):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe has nothing left to flush
            stream.flush()
    os._exit(code)
