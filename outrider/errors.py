"""User-facing errors.

Contract: any mistake a user can fix (a missing file, a mismatched vocabulary, malformed data,
a bad flag value) is raised as ``UserError`` with one line that says what is wrong and how to
fix it. The CLI prints that line and exits with status 2; it never shows a traceback for these.
Programming errors are left as ordinary exceptions.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input; the message is one line, shown as is."""

    exit_code = 2
    quiet = False  # True: another process printed this line already (rank 0 of a torchrun; the CLI stays silent)

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def require(condition: bool, message: str) -> None:
    """Raise ``UserError(message)`` unless ``condition`` holds."""
    if not condition:
        raise UserError(message)
