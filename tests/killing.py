"""Test helper: run a training in a child process and SIGKILL it once its checkpoint passes a step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def kill_training_after(code: str, args: list[str], out: Path, step: int = 2, timeout_s: float = 120.0) -> int:
    """Run ``python -c code *args``; SIGKILL it as soon as ``out/last/trainer_state.json`` records
    ``step`` or more; return the step its last checkpoint holds (the child must have been killed)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = out / "last" / "trainer_state.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if state.exists() and json.loads(state.read_text())["step"] >= step:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    return json.loads(state.read_text())["step"]
