"""Atomic file and directory writes.

Contract: a write either leaves the complete new content under the final name or leaves the
old content (if any) untouched; readers never see a half-written file. Files are written to a
temporary name in the same directory and renamed (``os.replace``, atomic on POSIX). Directories
are built under a temporary sibling name and swapped in. Nothing here fsyncs parent directories
on every call; durability across power loss is not a goal, crash-consistency is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from outrider.errors import UserError


def _umask_mode(path: str | os.PathLike, base: int = 0o666) -> None:
    """Give a ``mkstemp`` file (always 0600) the mode a plain ``open`` would have given it."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, base & ~mask)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike, what: str = "JSON") -> Any:
    """The JSON in ``path``, or a one-line ``UserError`` naming ``what`` the file should have been."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{what} file not found: {p}")
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {what} file {p}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{what} file {p} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def write_json_output(path: str | os.PathLike, obj: Any) -> Path | None:
    """What ``--json F`` means in every verb: write ``obj`` to the file F (atomically), or print it
    to standard output when F is ``-``."""
    if str(path) == "-":
        sys.stdout.write(json.dumps(obj, indent=2) + "\n")
        return None
    return atomic_write_json(path, obj)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it onto ``path``.

    For writers that insist on opening the file themselves (``torch.save``,
    ``safetensors.torch.save_file``). On error the temporary file is removed and ``path`` is
    left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        _umask_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces ``path`` as a whole.

    The previous directory (if any) is moved aside first and deleted only after the new one is
    in place, so at every instant either the old or the new complete directory exists under
    ``path`` (apart from the instant between the two renames, when ``path`` is absent).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _umask_mode(tmp, 0o777)
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
        os.rmdir(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
