"""Atomic file and directory writes, and the one reader of text, JSON and safetensors index files.

Contract: a write either leaves the complete new content under the final name or leaves the
old content (if any) untouched; readers never see a half-written file. Files are written to a
temporary name in the same directory (``.NAME.XXXXXXXX.tmp``) and renamed (``os.replace``, atomic
on POSIX). Directories are built under a temporary sibling name and swapped in: on Linux in one
step (``renameat2(RENAME_EXCHANGE)``), elsewhere by two renames. A temporary file or folder is
held under an OS lock (``flock``) while it is written, so that ``remove_stale_temps`` can tell a
killed run's leftovers (no lock: removed) from a live writer's (locked: kept). Nothing here fsyncs
parent directories on every call; durability across power loss is not a goal, crash-consistency is.

Every writer goes through ``atomic_path`` (files) or ``atomic_dir`` (folders): any ``OSError`` while
creating the temporary, writing it or renaming it (a pseudo file system, a missing parent, a name
the OS refuses, a full disk) is raised as ``OutputError``, one line naming the output as the user
named it (``os_error_line``). What they write honours the user's umask, including files that
libraries create 0600 (safetensors' ``save_file``).

Readers: ``read_text`` (UTF-8 or one line), ``read_json`` / ``read_json_object`` (one line naming the
file), ``safetensors_index`` (a checkpoint's tensor-to-shard map).
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

SAFETENSORS_INDEX = "model.safetensors.index.json"
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.(tmp|old)$")  # what mkstemp/mkdtemp below produce

USER_ERRNOS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file is too large for the file system",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "it is a folder, not a file",
    errno.ENAMETOOLONG: "the name is too long",
    errno.ELOOP: "too many symbolic links",
    errno.EBUSY: "it is busy (a mount point?)",
    errno.EXDEV: "it crosses file systems",
    errno.EMFILE: "too many open files",
}
_HINTS = {errno.ENOSPC: ": free some space and rerun (finished work is kept)",
          errno.EDQUOT: ": free some space and rerun (finished work is kept)",
          errno.EROFS: ": choose an output on a writable file system",
          errno.EACCES: ": choose a path you may write to, or fix its permissions"}


def os_error_line(e: OSError, fallback_path: Any = None) -> str:
    """One line for an ``OSError`` a user can fix: the path (as the user named it) and what is wrong."""
    path = shown_path(e.filename) or (str(fallback_path) if fallback_path else None)
    reason = USER_ERRNOS.get(e.errno, e.strerror or str(e))
    hint = _HINTS.get(e.errno, "")
    return f"{path}: {reason}{hint}" if path else f"{reason}{hint}"


class OutputError(UserError, OSError):
    """An ``OSError`` met while writing an output, told as one line naming that output. It is a
    ``UserError`` (the CLI prints it, exit 2) and still the ``OSError`` (``errno``, ``filename``),
    so a caller that falls back on an ``OSError`` (bench's record, a cache's finished shards) keeps
    doing so."""

    def __init__(self, path: str | os.PathLike, error: OSError):
        known = error.errno in USER_ERRNOS
        hint = "" if known else ": the system refused to create or write it there; choose another path"
        UserError.__init__(self, f"cannot write {os_error_line(error, path)}{hint}")
        self.errno, self.strerror, self.filename = error.errno, error.strerror, os.fspath(path)
        self.message = UserError.__str__(self)

    def __str__(self) -> str:
        return self.message


def output_error(path: str | os.PathLike, error: OSError) -> OutputError:
    """``error`` (raised while writing ``path``) as the one line that names ``path``."""
    if isinstance(error, OutputError):
        return error
    named = OSError(error.errno, error.strerror or str(error), os.fspath(path))
    return OutputError(path, named)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _umask_mode(path: str | os.PathLike, base: int = 0o666) -> None:
    """Give a ``mkstemp`` file (always 0600) the mode a plain ``open`` would have given it."""
    os.chmod(path, base & ~_umask())


def _umask_tree(folder: Path) -> None:
    """The modes a plain ``open``/``mkdir`` under the umask would give, for everything in ``folder``
    (a library may create its files 0600: safetensors does)."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            p = os.path.join(root, d)
            if not os.path.islink(p):
                os.chmod(p, 0o777 & ~mask)
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p):
                continue
            os.chmod(p, (0o777 if os.stat(p).st_mode & 0o100 else 0o666) & ~mask)


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


def guess_encoding(data: bytes) -> str | None:
    """A likely name for the encoding of bytes that are not UTF-8 (byte-order marks, the NUL bytes of
    UTF-16, else a single-byte Western code page), or None."""
    for bom, name in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                      (b"\xfe\xff", "UTF-16")):
        if data.startswith(bom):
            return name
    head = data[:4096]
    if head and head.count(0) > len(head) // 4:
        return "UTF-16"
    try:
        head.decode("cp1252")
    except UnicodeDecodeError:
        return None
    return "Windows-1252 or Latin-1"


def not_utf8(path: str | os.PathLike, data: bytes, error: UnicodeDecodeError, what: str = "") -> UserError:
    """The one line for a text file in another encoding: where it fails, and the encoding it looks like."""
    guess = guess_encoding(data)
    like = f", it looks like {guess}" if guess else ""
    return UserError(f"{path} is not UTF-8 (byte {error.start} is 0x{data[error.start]:02x}{like}): save it as UTF-8"
                     + (f" ({what})" if what else ""))


def read_text(path: str | os.PathLike, what: str = "") -> str:
    """The UTF-8 text of ``path``; another encoding is one ``UserError`` line (``not_utf8``). ``OSError``
    propagates."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise not_utf8(path, data, e, what) from None


def read_json(path: str | os.PathLike, what: str | None = None) -> Any:
    """The JSON in ``path``, or one ``UserError`` line: naming ``what`` the file should have been, or
    (``what`` None) ``cannot read PATH: reason``."""
    p = Path(path).expanduser()
    if what is None:
        try:
            return json.loads(read_text(p))
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {p}: {e}") from None
    if not p.is_file():
        raise UserError(f"{what} file not found: {p}")
    try:
        return json.loads(read_text(p, f"a {what} file"))
    except OSError as e:
        raise UserError(f"cannot read {what} file {p}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{what} file {p} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """``read_json`` of a file that must hold a JSON object."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object")
    return data


def safetensors_index(folder: str | os.PathLike) -> dict[str, str] | None:
    """Tensor name -> shard file name, from ``folder``'s ``model.safetensors.index.json`` (None: no index)."""
    index = Path(folder) / SAFETENSORS_INDEX
    if not index.exists():
        return None
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"cannot read {index}: no 'weight_map' object of tensor names to files")
    return weight_map


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise output_error(path, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # live: remove_stale_temps leaves it alone
        yield Path(tmp)
        _umask_mode(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise output_error(path, e) from None
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as e:
        raise output_error(path, e) from None
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # live: remove_stale_temps leaves it alone
        try:
            yield tmp
            _umask_tree(tmp)
            for name in carry:
                if (path / name).is_file() and not (tmp / name).exists():
                    os.link(path / name, tmp / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            _swap_in(tmp, path)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise output_error(path, e) from None
    finally:
        os.close(fd)


def _swap_in(tmp: Path, path: Path) -> None:
    """``tmp`` becomes ``path``: one exchange where the system has one, else two renames."""
    if path.exists() and exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # the old directory, now under the temporary name
        return
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
        os.rmdir(old)
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except OSError:
        if old is not None:
            os.replace(old, path)  # the earlier output back under its name
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
