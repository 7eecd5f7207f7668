"""``python -m outrider`` (and ``torchrun -m outrider``) run the CLI."""

from outrider.cli import entry

entry()
