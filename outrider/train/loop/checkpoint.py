"""A training run's files: the resumable state in ``last/``, the metrics log, head folders.

Contract:
- ``last/`` holds ``head/`` (the current head, the vLLM layout in float32 with the ``outrider``
  section), ``draft_vocab.safetensors``, ``trainer_state.pt`` (optimizer, scheduler, RNG states,
  data position, step, best score, config) and ``trainer_state.json`` (a readable summary). It is
  swapped in whole (``fsutil.atomic_dir``): a run killed at any point leaves the previous complete
  ``last/``. The state holds tensors and plain Python values only, and is read back with
  ``torch.load(weights_only=True)``: a checkpoint from elsewhere never runs code (states written
  before the RNG states became tensors are read with numpy's array types allowed, nothing more).
- ``metrics.jsonl``: one JSON object per line, appended and flushed; ``cut_metrics`` keeps the
  complete lines up to a step (a killed run may have logged past its checkpoint).
- ``init_head_dir`` resolves ``--init``: a head folder, or an earlier run's output (its ``head/``).

Not done here: what the state means (``trainer``), the head's own format (``interop.formats.export``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from outrider.errors import UserError
from outrider.fsutil import atomic_dir, atomic_write_text

STATE_FORMAT = "outrider-train-state"
STATE_VERSION = 2  # 2: RNG states as tensors (weights_only); 1: numpy's state as an array


def rng_state() -> dict[str, Any]:
    """Python's, numpy's, torch's (and CUDA's) RNG states as tensors and plain values."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    internal = tuple(internal.tolist()) if isinstance(internal, torch.Tensor) else tuple(internal)
    random.setstate((version, internal, gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_state_globals() -> list:
    """The numpy types a version-1 state pickled (its RNG state held an array): data, no code."""
    multiarray = getattr(np, "_core", None) or np.core
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_state(last_dir: Path) -> dict[str, Any]:
    """The training state in ``last_dir``; a one-line ``UserError`` when it is absent or unreadable."""
    path = last_dir / "trainer_state.pt"
    if not path.exists():
        raise UserError(f"nothing to resume: {last_dir} holds no checkpoint; start without --resume")
    try:
        with torch.serialization.safe_globals(_numpy_state_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise UserError(f"cannot read the checkpoint {path}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise UserError(f"{path} is not an outrider training state")
    return state


def write_state(last_dir: Path, state: dict[str, Any], save_head: Callable[[Path], None], vocab: Any,
                readable: dict[str, Any]) -> None:
    """Swap in a new ``last/``: the head (``save_head(folder)``), the vocabulary, the state and its summary."""
    with atomic_dir(last_dir) as tmp:
        save_head(tmp / "head")
        vocab.save(tmp)
        with open(tmp / "trainer_state.pt", "wb") as f:  # a Python file: a full disk surfaces as its OSError
            torch.save(state, f)
        (tmp / "trainer_state.json").write_text(json.dumps(readable, indent=2) + "\n")


def append_metric(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def cut_metrics(path: Path, step: int) -> None:
    """Keep the complete metric lines up to ``step``."""
    kept = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and int(rec.get("step", 0)) <= step:
                kept.append(line)
    atomic_write_text(path, "".join(k + "\n" for k in kept))


def init_head_dir(path: str | Path) -> Path:
    """A head folder, or a training output directory (its best ``head/``)."""
    p = Path(path).expanduser()
    if not (p / "config.json").exists() and (p / "head" / "config.json").exists():
        return p / "head"
    if not (p / "config.json").exists():
        raise UserError(f"--init {p} is not an EAGLE-3 head folder (no config.json): give a head folder or the "
                        "--out of an earlier training run")
    return p
