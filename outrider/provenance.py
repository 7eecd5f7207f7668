"""Where a record came from: the checkout's commit and today's date, as records carry them.

Contract: ``git_commit()`` is the short commit of the checkout this package runs from, or None
outside a git checkout (an installed package); ``today()`` the UTC date, ``YYYY-MM-DD``. Records
that a reader (``plan``, ``report``) shows later carry both, next to the device they ran on.
Nothing here imports torch.
"""

from __future__ import annotations

import datetime as _dt
import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The checkout's short commit, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
