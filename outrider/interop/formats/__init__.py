"""The export format registry: ``FORMATS`` maps a name to its ``HeadFormat`` (``formats.base``).

Contract: the CLI's ``--format`` choices, export and the checkpoint reader all dispatch through
``FORMATS``, in this order. A new format is one module defining ``FORMAT`` plus one line below.
Writing is ``formats.export``.
"""

from __future__ import annotations

from outrider.errors import UserError
from outrider.interop.formats import sglang, speculators, vllm
from outrider.interop.formats.base import HeadFormat

FORMATS: dict[str, HeadFormat] = {f.name: f for f in (
    sglang.FORMAT,
    vllm.FORMAT,
    speculators.FORMAT,
)}


def get_format(name: str) -> HeadFormat:
    """The registered format ``name``; ``UserError`` naming the choices otherwise."""
    if name not in FORMATS:
        raise UserError(f"unknown export format '{name}': use one of {', '.join(FORMATS)}")
    return FORMATS[name]


def format_of(cfg: dict) -> HeadFormat | None:
    """The first registered format whose folders look like this config.json, or None."""
    return next((f for f in FORMATS.values() if f.recognises(cfg)), None)
