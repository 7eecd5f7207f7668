"""Values inside inputs, checked when they are loaded: token ids within the vocabulary, draft
vocabulary maps within both vocabularies, no NaN or Inf in floating-point tensors.

Contract: each check raises one ``UserError`` line naming the file and the tensor (or column),
what is wrong (the first offending value, how many) and what to do; ``nonfinite`` only counts
(for ``inspect``, which reports rather than refuses). A checksum says a file is the one that was
written; these say that what was written is usable: a shard with a token id past the vocabulary
would index past the embedding, a NaN weight would make every draft NaN.
Not done here: shapes and names (``interop.checkpoint``), checksums (``train.states.cache``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from outrider.errors import UserError

CHUNK = 1 << 24  # elements checked at a time: a bounded float copy of a large tensor


def nonfinite(t: torch.Tensor) -> int:
    """How many NaN/Inf values a floating-point tensor holds (0 for integer and bool tensors)."""
    if not (t.is_floating_point() or t.is_complex()):
        return 0
    flat = t.reshape(-1)
    bad = 0
    for i in range(0, flat.numel(), CHUNK):
        part = flat[i:i + CHUNK]
        if part.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            part = part.float()  # fp8 kinds: isfinite is defined on the wider type
        bad += int((~torch.isfinite(part)).sum())
    return bad


def check_finite(tensors: dict[str, torch.Tensor] | Any, where: str, fix: str) -> None:
    """Refuse the first tensor (in name order) holding NaN or Inf."""
    for name in sorted(tensors):
        n = nonfinite(tensors[name])
        if n:
            raise UserError(f"{where}: tensor {name} holds {n} non-finite value(s) (NaN or Inf): {fix}")


def check_ids(ids: np.ndarray | torch.Tensor, vocab_size: int, where: str, what: str, fix: str) -> None:
    """Refuse token ids outside ``0..vocab_size-1``."""
    arr = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if arr.size == 0:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = int(((arr < 0) | (arr >= vocab_size)).sum())
        raise UserError(f"{where}: {what} holds {bad} token id(s) outside the vocabulary 0..{vocab_size - 1} (e.g. "
                        f"{lo if lo < 0 else hi}): {fix}")


def check_draft_map(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int, where: str) -> None:
    """``target_id = i + d2t[i]`` within the target vocabulary, distinct, and marked in ``t2d`` [vocab]."""
    targets = torch.arange(d2t.numel()) + d2t.long()
    fix = "the head's draft vocabulary is damaged or was built for another target; retrain or re-export it"
    if d2t.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        bad = int(((targets < 0) | (targets >= vocab_size)).sum())
        raise UserError(f"{where}: tensor d2t maps {bad} draft id(s) outside the target vocabulary "
                        f"0..{vocab_size - 1}: {fix}")
    if targets.unique().numel() != targets.numel():
        raise UserError(f"{where}: tensor d2t maps two draft ids to one target id: {fix}")
    if t2d is not None:
        t2d = t2d.bool().reshape(-1)
        if t2d.numel() != vocab_size or int(t2d.sum()) != d2t.numel() or not bool(t2d[targets].all()):
            raise UserError(f"{where}: tensor t2d disagrees with d2t (every draft id's target must be marked, "
                            f"nothing else, over {vocab_size} ids): {fix}")
