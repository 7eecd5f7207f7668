"""What a verb may write to: output folders and files claimed, recognised, locked, never destroyed.

Contract:
- A folder output (``data --out``, ``train --out``, ``capture --out``, ``export --out``, ``demo
  --out``, ``plan --plot``) is claimed with ``claim_dir(path, kind)`` before any work starts. The
  claim succeeds on a new or empty folder, or on one that holds an earlier output of the same
  kind: the marker file ``.outrider-output`` (``{"kind": ...}``) that the claim writes, or, for
  folders written before markers existed, the files that kind always writes (``LEGACY``). It
  refuses with one line a path that is a file, a folder holding anything else (another kind of
  output, or files outrider did not write), and a folder that is, or holds, one of the verb's
  inputs. ``force`` never widens that: ``Claim.clear`` empties only a folder of the claimed kind.
- One writer per output: the claim holds an OS lock (``flock``) on ``.outrider-lock`` inside the
  folder, which the process's death releases; a second claim refuses at once, naming the holder's
  pid. Outputs replaced as a whole (``fsutil.atomic_dir``) carry the marker and the lock file into
  the new folder as hard links (``OWN_FILES``), so the lock stays held across the swap.
- Under the lock, temporaries a killed run left in the folder or next to it are removed
  (``fsutil.remove_stale_temps``). A claim that created the folder removes it again when the
  verb fails before writing anything.
- A file output (``--json F``, ``plan --out F``, ``report --out F``) is checked with
  ``check_file(path, kind)`` before the verb starts: not a folder, nor a device, pipe or socket, its first existing parent a
  writable folder, and an existing file replaced only when it is an earlier output of the same
  kind (``FILE_KINDS``); ``-`` (standard output) is always fine. It is then written through
  ``fsutil`` (``write_json_output``, ``atomic_write_text``), whose every ``OSError`` is one line
  naming it; so is any ``OSError`` while claiming a folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outrider.errors import UserError
from outrider.fsutil import TEMP_NAME, atomic_write_json, output_error, remove_stale_temps

MARKER = ".outrider-output"
LOCK = ".outrider-lock"
OWN_FILES = (MARKER, LOCK)

KINDS = {  # kind -> what the verb calls it, in messages
    "dataset": "token dataset (`outrider data`)",
    "run": "training run (`outrider train`)",
    "cache": "hidden-state cache (`outrider capture`)",
    "export": "exported head (`outrider export`)",
    "demo": "demo folder (`outrider demo`)",
    "plots": "plan plots (`outrider plan --plot`)",
}


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _format_is(path: Path, name: str) -> bool:
    data = _json(path)
    return isinstance(data, dict) and data.get("format") == name


LEGACY: dict[str, Callable[[Path], bool]] = {  # folders written before the marker existed (the formats
    # are outrider.train.data.datasets.FORMAT and outrider.train.states.cache.FORMAT, not imported: they load torch)
    "dataset": lambda d: _format_is(d / "manifest.json", "outrider-tokens"),
    "run": lambda d: (d / "train_config.json").is_file() or (d / "last" / "trainer_state.json").is_file(),
    "cache": lambda d: _format_is(d / "header.json", "outrider-hidden-cache"),
    "export": lambda d: all((d / n).is_file() for n in ("config.json", "model.safetensors", "LAUNCH.md")),
    "demo": lambda d: (d / "summary.md").is_file() or (d / "data" / "manifest.json").is_file(),
}


def _records_with(data: Any, *keys: str) -> bool:
    return isinstance(data, list) and all(isinstance(r, dict) and all(k in r for k in keys) for r in data)


FILE_KINDS: dict[str, tuple[str, Callable[[Path], bool]]] = {  # kind -> (what writes it, recogniser)
    "bench": ("`outrider bench --json`", lambda p: _records_with(_json(p), "method", "tau")),
    "plan": ("`outrider plan --json`", lambda p: _records_with(_json(p), "method", "k", "batch", "speedup")),
    "train-plan": ("`outrider plan --train --json`",
                   lambda p: isinstance(d := _json(p), dict) and "stages" in d and "sizes" in d),
    "train-plan-md": ("`outrider plan --train --out`", lambda p: p.read_bytes().startswith(b"# Training plan")),
    "report": ("`outrider report --out`",
               lambda p: b'<meta name="generator" content="outrider report">' in p.read_bytes()[:400]),
    "inspect": ("`outrider inspect --json`",
                lambda p: isinstance(d := _json(p), dict) and "servable" in d and "checks" in d),
}


def _a(what: str) -> str:
    return ("an " if what[0] in "aeiou" else "a ") + what


def kind_of(folder: Path) -> str | None:
    """The kind of outrider output ``folder`` holds (its marker, else the files a kind writes)."""
    marker = _json(folder / MARKER)
    if isinstance(marker, dict) and marker.get("kind") in KINDS:
        return marker["kind"]
    return next((k for k, seen in LEGACY.items() if seen(folder)), None)


def _contents(folder: Path) -> list[str]:
    """What the folder holds besides the claim's own files and temporaries."""
    return sorted(n for n in os.listdir(folder) if n not in OWN_FILES and not TEMP_NAME.match(n))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _check_inputs(out: Path, inputs: Iterable[str | os.PathLike | None], flag: str) -> None:
    for given in inputs:
        if given is None:
            continue
        path = Path(given).expanduser()
        if not path.exists():
            continue  # a name (sharegpt, default, a preset), not a path
        path = path.resolve()
        if _within(path, out):
            what = "is the input" if path == out else f"holds the input {given}"
            raise UserError(f"{flag} {out} {what}: writing there would overwrite it; choose another {flag}")


@dataclass
class Claim:
    """A claimed output folder: ``path`` (absolute), its ``kind``, and the lock held on it."""

    path: Path
    kind: str
    created: bool
    existing: list[str] = field(default_factory=list)  # what the folder held when claimed
    fd: int | None = None

    def clear(self) -> None:
        """Empty the folder (it holds an earlier output of this kind; the marker and lock stay)."""
        for name in _contents(self.path):
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        self.existing = []

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


def _lock(folder: Path, flag: str) -> int:
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"{folder} is being written by another outrider process (pid {holder}): wait for it to "
                        f"finish, or choose another {flag}") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def wait_for_writer(folder: str | os.PathLike, proc: Any, timeout_s: float = 120.0) -> bool:
    """For tools that drive outrider: wait until the process ``proc`` (a ``subprocess.Popen``) holds
    the lock of ``folder``; False if it ended or the time ran out first."""
    lock = Path(folder) / LOCK
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if lock.exists() and lock.read_text().strip() == str(proc.pid):
            return True
        time.sleep(0.02)
    return False


def _existing_parent(resolved: Path, path: Any, flag: str) -> Path:
    """The nearest existing folder above an output path; one line when that is a file."""
    parent = next(q for q in resolved.parents if q.exists())  # the root always exists
    if not parent.is_dir():
        raise UserError(f"{flag} {path} lies under {parent}, which is a file, not a folder")
    return parent


def inspect_dir(path: str | os.PathLike, kind: str, flag: str = "--out",
                inputs: Iterable[str | os.PathLike | None] = ()) -> tuple[Path, list[str]]:
    """The checks of ``claim_dir`` that need no lock: (absolute path, what it holds now)."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    given = Path(path).expanduser()
    out = given.resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder: give a folder path (new, or an earlier "
                        f"{KINDS[kind]} output)")
    _existing_parent(out, path, flag)
    _check_inputs(out, inputs, flag)
    existing = _contents(out) if out.is_dir() else []
    if existing:
        have = kind_of(out)
        if have is None:
            shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
            raise UserError(f"{flag} {path} holds files outrider did not write ({shown}): choose a new or empty "
                            "folder (outrider never deletes what it did not write)")
        if have != kind:
            raise UserError(f"{flag} {path} holds {_a(KINDS[have])}, not {_a(KINDS[kind])}: choose another folder "
                            "(--force replaces only an output of the same kind)")
    return out, existing


@contextlib.contextmanager
def claim_dir(path: str | os.PathLike, kind: str, flag: str = "--out",
              inputs: Iterable[str | os.PathLike | None] = (), lock: bool = True) -> Iterator[Claim]:
    """Claim the output folder ``path`` for ``kind`` (see the module docstring) while the block runs.

    ``inputs``: the verb's input paths (names that are not paths are skipped). ``lock=False``
    checks but takes no lock (the other ranks of a distributed run, whose rank 0 holds it).
    """
    out, existing = inspect_dir(path, kind, flag, inputs)
    created = not out.exists()
    if not lock:
        yield Claim(out, kind, created, existing)
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = _lock(out, flag)
    except OSError as e:
        raise output_error(path, e) from None
    claim = Claim(out, kind, created, existing, fd)
    try:
        if kind_of(out) != kind or not (out / MARKER).is_file():
            atomic_write_json(out / MARKER, {"kind": kind, "written_by": "outrider", "what": KINDS[kind]})
        remove_stale_temps(out, inside=True)
        yield claim
    except BaseException:
        if created and out.is_dir() and not _contents(out):
            shutil.rmtree(out, ignore_errors=True)  # nothing was written: leave no empty folder behind
        raise
    finally:
        claim.release()


def check_file(path: str | os.PathLike | None, kind: str, flag: str = "--json") -> None:
    """Refuse (one line) a file output that would fail or destroy something; clean its stale temporaries."""
    if path is None or str(path) == "-":
        return
    p = Path(path).expanduser()
    what, recognised = FILE_KINDS[kind]
    if p.is_dir():
        raise UserError(f"{flag} {path} is a folder: give a file name")
    if p.exists() and not p.is_file():
        raise UserError(f"{flag} {path} is not a regular file (a device, a pipe or a socket): give a file name "
                        "(outrider replaces its output file whole, which would remove it)")
    parent = _existing_parent(p.resolve(), path, flag)
    if not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path} cannot be written: {parent} is read-only or not writable for you; "
                        "choose another path")
    if p.is_file() and p.stat().st_size > 0 and not recognised(p):
        raise UserError(f"{flag} {path} exists and is not an earlier {what} output: choose another file name "
                        "(outrider never overwrites other files)")
    remove_stale_temps(p)
