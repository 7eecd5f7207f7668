"""Where a record came from: the checkout's commit and today's date, as records carry them.

Contract: ``git_commit()`` is the short commit of the checkout this package runs from (``-dirty``
when its tracked files differ), or None outside a git checkout (an installed package); ``today()``
the UTC date, ``YYYY-MM-DD``. Records that a reader (``plan``, ``report``) shows later carry both, next to the device they ran on.
Nothing here imports torch.
"""

from __future__ import annotations

import datetime as _dt
import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The checkout's short commit, with ``-dirty`` when tracked files differ from it (a copied tree
    beside an older ``.git``, uncommitted edits); None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                             timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    if not commit:
        return None
    return commit + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
