"""Atomic file and directory writes.

Contract: a write either leaves the complete new content under the final name or leaves the
old content (if any) untouched; readers never see a half-written file. Files are written to a
temporary name in the same directory (``.NAME.XXXXXXXX.tmp``) and renamed (``os.replace``, atomic
on POSIX). Directories are built under a temporary sibling name and swapped in: on Linux in one
step (``renameat2(RENAME_EXCHANGE)``), elsewhere by two renames. A temporary file or folder is
held under an OS lock (``flock``) while it is written, so that ``remove_stale_temps`` can tell a
killed run's leftovers (no lock: removed) from a live writer's (locked: kept). Nothing here fsyncs
parent directories on every call; durability across power loss is not a goal, crash-consistency is.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from outrider.errors import UserError

TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.(tmp|old)$")  # what mkstemp/mkdtemp below produce


def _umask_mode(path: str | os.PathLike, base: int = 0o666) -> None:
    """Give a ``mkstemp`` file (always 0600) the mode a plain ``open`` would have given it."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, base & ~mask)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
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
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # live: remove_stale_temps leaves it alone
        yield Path(tmp)
        _umask_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the system or the file system cannot (then nothing moved); raises
    ``OSError`` for any other failure."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(b))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, carry: Iterable[str] = ()) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces ``path`` as a whole.

    The swap is one atomic exchange where the system has one (Linux), so that at every instant
    ``path`` holds the old or the new complete directory; elsewhere the old directory is moved
    aside first and deleted only after the new one is in place (``path`` is absent between the
    two renames). ``carry``: names of files in the old directory that the new one keeps, as hard
    links to the same files (an output's marker and lock file: a lock held on it stays held).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # live: remove_stale_temps leaves it alone
        try:
            yield tmp
            _umask_mode(tmp, 0o777)
            for name in carry:
                if (path / name).is_file() and not (tmp / name).exists():
                    os.link(path / name, tmp / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if path.exists() and exchange(tmp, path):
            shutil.rmtree(tmp, ignore_errors=True)  # the old directory, now under the temporary name
            return
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.rmdir(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        os.close(fd)


def _stale(candidate: Path) -> bool:
    """A temporary file or folder no live writer holds (its ``flock`` is free)."""
    try:
        fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def remove_stale_temps(path: str | os.PathLike, inside: bool = False) -> list[Path]:
    """Remove what killed writers of ``path`` left: its ``.NAME.XXXXXXXX.tmp``/``.old`` siblings and,
    with ``inside`` (a folder output), any such temporary anywhere in it. Live ones are kept."""
    path = Path(path)
    found: list[Path] = []
    with contextlib.suppress(OSError):
        found += [p for p in path.parent.iterdir() if (m := TEMP_NAME.match(p.name)) and m["name"] == path.name]
    if inside and path.is_dir():
        for root, dirs, files in os.walk(path):
            found += [Path(root, n) for n in dirs + files if TEMP_NAME.match(n)]
            dirs[:] = [d for d in dirs if not TEMP_NAME.match(d)]
    removed = []
    for p in found:
        if p.is_symlink() or not _stale(p):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        removed.append(p)
    return removed


def shown_path(name: str | os.PathLike | None) -> str | None:
    """A path as the user named it: a temporary ``.NAME.XXXXXXXX.tmp`` is shown as ``NAME``."""
    if name is None:
        return None
    p = Path(os.fsdecode(name))
    m = TEMP_NAME.match(p.name)
    return str(p.with_name(m["name"])) if m else str(p)
