"""An engine server as a child process: started on a free local port, waited for, always stopped.

Contract: ``ServerProcess(argv, env=..., log=...)`` is a context manager. ``start()`` runs
``argv`` (a server command line such as ``vllm serve MODEL ...``; ``{port}`` in any argument is
replaced by a free port on 127.0.0.1) in its own process group with stdout and stderr going to
``log``; ``wait_ready(timeout)`` polls ``GET {url}/v1/models`` until it answers, and raises
``ServerFailed`` with the log's last meaningful line (the engine's own error) when the process
exits first or the time runs out; ``stop()`` ends the whole process group (SIGTERM, then
SIGKILL after ``grace`` seconds), also on exceptions and interrupts. ``error_line(log)`` is that
last meaningful line.

Not done here: installing an engine (the test suite's engine tier does), building its command
line (LAUNCH.md and the callers do), talking to the API (``openai_client``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

# lines that are noise around an engine's real error (tracebacks' frames, blank lines, progress)
_NOISE = re.compile(r"^\s*(File \"|Traceback|\^|~|During handling|The above exception|raise |return |\S+\(|$)")


class ServerFailed(RuntimeError):
    """The server exited or never answered; ``line`` is its own last error line."""

    def __init__(self, line: str, log: Path | None = None):
        super().__init__(line)
        self.line = line
        self.log = log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def error_line(log: str | os.PathLike, fallback: str = "the server exited without a message",
               width: int = 300) -> str:
    """The last line of ``log`` that names an error (``...Error: ...``; not a wrapper that points back
    at "the root cause above"), with the indented detail line that follows it (pydantic's ``Value
    error, ...``), else its last meaningful line; at most ``width`` characters."""
    try:
        raw = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return fallback
    keep = [i for i, ln in enumerate(raw) if not _NOISE.match(ln)]
    named = [i for i in keep if re.search(r"\b\w*(Error|Exception)\b:", raw[i])
             and not re.search(r"(root cause|stack trace) above", raw[i])]  # a wrapper pointing back at the cause
    if not keep:
        return fallback
    i = named[-1] if named else keep[-1]
    pick = raw[i].strip()
    detail = raw[i + 1] if i + 1 < len(raw) else ""
    if named and detail[:1].isspace() and not _NOISE.match(detail) and "further information" not in detail:
        pick = f"{pick}: {detail.strip()}"
    pick = re.sub(r"^(ERROR|INFO|WARNING) [\d\-: ]+\[[^\]]*\]\s*", "", re.sub(r"^\(\w+ pid=\d+\)\s*", "", pick))
    return pick if len(pick) <= width else pick[: width - 3] + "..."


class ServerProcess:
    """One server child process (see the module docstring)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
                 log: str | os.PathLike = "server.log", host: str = "127.0.0.1", grace: float = 20.0):
        self.port = free_port()
        self.argv = [str(a).replace("{port}", str(self.port)) for a in argv]
        self.env = dict(os.environ if env is None else env)
        self.log = Path(log)
        self.url = f"http://{host}:{self.port}"
        self.grace = grace
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 300.0, path: str = "/v1/models") -> "ServerProcess":
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(error_line(self.log), self.log)
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise ServerFailed(f"no answer on {self.url}{path} within {timeout:.0f} s; last log line: "
                           f"{error_line(self.log, 'none')}", self.log)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=self.grace)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
