"""The draft vocabulary: which target tokens an EAGLE-3 head can propose.

Contract (DESIGN.md, "Draft vocabulary"):
- Built from the frequency of target tokens at loss-masked (assistant) positions. The draft
  vocabulary is the top ``N`` tokens (default ``min(32000, target vocab)``) by count; ties are
  broken by the smaller target id. If fewer than ``N`` distinct tokens occur, the remaining
  places go to the never-seen ids in increasing id order (the same rule: count 0, smaller id
  first), so the size is always exactly ``N``.
- Draft id ``i`` is the ``i``-th smallest selected target id (``draft_ids`` ascending), so
  ``d2t[i] = draft_ids[i] - i`` is a non-negative, non-decreasing int64 offset with
  ``target_id = i + d2t[i]``, and ``t2d`` is a bool mask over the target vocabulary.
- Stored next to every checkpoint as ``draft_vocab.safetensors`` (``d2t``, ``t2d``, ``counts``;
  metadata: sizes, total count), written atomically. ``check_same`` refuses, with a
  ``UserError``, a resumed run whose vocabulary would differ from the checkpoint's.
- ``run_vocab``: a training run's vocabulary: built from its data, kept from an ``--init`` head,
  or the checkpoint's on resume.

Not done here: choosing N from a coverage target, merging vocabularies of several runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from outrider.errors import UserError
from outrider.fsutil import atomic_path

FILENAME = "draft_vocab.safetensors"
FORMAT = "outrider-draft-vocab"
VERSION = 1
MAX_DEFAULT_SIZE = 32000



def draft_lookup(draft_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Target id -> draft id ``[target_vocab]`` (``-1`` outside the draft vocabulary), on ``draft_ids``'
    device; draft_ids: the target id of each draft id, ``[draft_vocab]``."""
    lookup = torch.full((target_vocab,), -1, dtype=torch.long, device=draft_ids.device)
    lookup[draft_ids] = torch.arange(draft_ids.numel(), device=draft_ids.device)
    return lookup

@dataclass(frozen=True, eq=False)
class DraftVocab:
    """A draft vocabulary over a target vocabulary of ``t2d.numel()`` tokens."""

    d2t: torch.Tensor  # [draft_vocab] int64, target_id = i + d2t[i]
    t2d: torch.Tensor  # [vocab] bool, True on target ids in the draft vocabulary
    draft_ids: torch.Tensor  # [draft_vocab] int64 target ids, ascending
    counts: torch.Tensor  # [draft_vocab] int64 loss-masked occurrences of each draft token
    total: int = 0  # loss-masked tokens counted in all (0 when unknown)

    @classmethod
    def from_draft_ids(cls, draft_ids: torch.Tensor, target_vocab_size: int,
                       counts: torch.Tensor | None = None, total: int = 0) -> "DraftVocab":
        # draft_ids: [draft_vocab] distinct target ids (any order)
        ids, order = torch.as_tensor(draft_ids, dtype=torch.long).sort()
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= target_vocab_size:
            raise UserError(f"draft token ids must be in 0..{target_vocab_size - 1} (the target's vocabulary)")
        if bool((ids[1:] == ids[:-1]).any()):
            raise UserError("draft token ids must be distinct")
        counts = torch.zeros_like(ids) if counts is None else torch.as_tensor(counts, dtype=torch.long)[order]
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return cls(d2t=ids - torch.arange(ids.numel()), t2d=t2d, draft_ids=ids, counts=counts, total=int(total))

    @classmethod
    def from_mapping(cls, d2t: torch.Tensor, t2d: torch.Tensor) -> "DraftVocab":
        """From a head's buffers (counts unknown): d2t [draft_vocab] int64, t2d [vocab] bool."""
        d2t = torch.as_tensor(d2t, dtype=torch.long).cpu()
        t2d = torch.as_tensor(t2d).bool().cpu()
        vocab = cls.from_draft_ids(torch.arange(d2t.numel()) + d2t, t2d.numel())
        if not torch.equal(vocab.t2d, t2d) or not torch.equal(vocab.d2t, d2t):
            raise UserError("d2t and t2d disagree (d2t must be ascending offsets and t2d mark exactly its targets)")
        return vocab

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    def coverage(self) -> float:
        """Fraction of the counted loss-masked tokens that the draft vocabulary can propose."""
        return float(self.counts.sum()) / self.total if self.total else float("nan")

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids."""
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) -> draft ids, ``-1`` where the token is not in the draft vocabulary."""
        return draft_lookup(self.draft_ids.to(target_ids.device), self.target_vocab_size)[target_ids]

    def fingerprint(self) -> str:
        """sha256 over the sizes and the mapping (not the counts)."""
        h = hashlib.sha256(f"{self.target_vocab_size}:{self.draft_vocab_size}:".encode())
        h.update(self.draft_ids.numpy().astype("<i8").tobytes())
        return h.hexdigest()

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/draft_vocab.safetensors`` atomically; returns its path."""
        from safetensors.torch import save_file

        path = Path(directory) / FILENAME
        meta = {"format": FORMAT, "version": str(VERSION), "target_vocab_size": str(self.target_vocab_size),
                "draft_vocab_size": str(self.draft_vocab_size), "total": str(self.total)}
        tensors = {"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous(), "counts": self.counts.contiguous()}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "DraftVocab":
        """Read what ``save`` wrote (give the checkpoint directory or the file itself)."""
        from safetensors import SafetensorError, safe_open

        path = Path(directory)
        if path.is_dir():
            path = path / FILENAME
        if not path.exists():
            raise UserError(f"no draft vocabulary at {path}: not an outrider checkpoint, "
                            "or it was written incompletely")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in ("d2t", "t2d", "counts")}
        except (SafetensorError, OSError, KeyError) as e:
            raise UserError(f"cannot read the draft vocabulary {path}: {e}") from None
        if meta.get("format") != FORMAT:
            raise UserError(f"{path} is not an outrider draft vocabulary (format {meta.get('format')!r})")
        vocab = cls.from_mapping(tensors["d2t"], tensors["t2d"])
        return cls(d2t=vocab.d2t, t2d=vocab.t2d, draft_ids=vocab.draft_ids,
                   counts=tensors["counts"].long(), total=int(meta.get("total", 0)))

    def summary(self) -> dict[str, Any]:
        return {"target_vocab_size": self.target_vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "coverage": self.coverage(), "fingerprint": self.fingerprint()}


def token_counts(source: Any, target_vocab_size: int) -> torch.Tensor:
    """Counts [vocab] int64 of target tokens at loss-masked positions.

    ``source`` is either such counts already (a 1-D tensor or array of length ``vocab``) or an
    iterable of ``(input_ids, loss_mask)`` pairs (tensors, arrays or lists of equal shape).
    """
    if isinstance(source, (torch.Tensor, np.ndarray)) and np.ndim(source) == 1:
        counts = torch.as_tensor(source).long()
        if counts.numel() != target_vocab_size:
            raise UserError(f"token counts cover {counts.numel()} ids but the target vocabulary "
                            f"has {target_vocab_size}")
        return counts
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for input_ids, loss_mask in source:
        ids = torch.as_tensor(input_ids).long().reshape(-1)
        mask = torch.as_tensor(loss_mask).reshape(-1) != 0
        if ids.shape != mask.shape:
            raise UserError(f"input_ids and loss_mask differ in length ({ids.numel()} vs {mask.numel()})")
        ids = ids[mask]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size):
            raise UserError(f"token id {int(ids.max())} is outside the target vocabulary of {target_vocab_size}: "
                            "the data was tokenised with another tokenizer; rerun `outrider data` with this target")
        counts += torch.bincount(ids, minlength=target_vocab_size)
    return counts


def build_draft_vocab(source: Any, target_vocab_size: int, draft_vocab_size: int | None = None) -> DraftVocab:
    """Top-N target tokens by loss-masked frequency (see the module docstring for ties and filling)."""
    counts = token_counts(source, target_vocab_size)  # [vocab]
    n = min(MAX_DEFAULT_SIZE, target_vocab_size) if draft_vocab_size is None else int(draft_vocab_size)
    if not 0 < n <= target_vocab_size:
        raise UserError(f"draft vocabulary size {n} must be in 1..{target_vocab_size} (the target's vocabulary)")
    total = int(counts.sum())
    if total == 0:
        raise UserError("no loss-masked tokens to build the draft vocabulary from: the data has no assistant tokens")
    order = torch.sort(-counts, stable=True).indices  # count descending, then id ascending
    chosen = order[:n]
    return DraftVocab.from_draft_ids(chosen, target_vocab_size, counts[chosen], total)


def check_same(checkpoint: DraftVocab, current: DraftVocab) -> None:
    """Refuse (``UserError``) when ``current`` differs from the ``checkpoint``'s vocabulary."""
    problem = ""
    if checkpoint.target_vocab_size != current.target_vocab_size:
        problem = f"target vocabulary {checkpoint.target_vocab_size} vs {current.target_vocab_size} tokens"
    elif checkpoint.draft_vocab_size != current.draft_vocab_size:
        problem = f"{checkpoint.draft_vocab_size} vs {current.draft_vocab_size} draft tokens"
    elif not torch.equal(checkpoint.draft_ids, current.draft_ids):
        diff = (checkpoint.draft_ids != current.draft_ids).nonzero()
        i = int(diff[0])
        problem = (f"{diff.numel()} of {checkpoint.draft_vocab_size} draft ids map elsewhere (first: draft id {i} is "
                   f"target {int(checkpoint.draft_ids[i])} in the checkpoint, {int(current.draft_ids[i])} now)")
    if problem:
        raise UserError(f"draft vocabulary differs from the checkpoint's: {problem}; resume or fine-tune with the "
                        "checkpoint's vocabulary (same data and size) or train into a new output directory")



def run_vocab(train_ds: Any, vocab_size: int, size: int, init: DraftVocab | None = None,
              saved: DraftVocab | None = None, data_changed: bool = False) -> tuple[DraftVocab, list[str]]:
    """(the run's draft vocabulary, notes): built from ``train_ds``'s loss-token counts with ``size``
    rows; ``init``'s rows kept (a fine-tune); a resumed run's ``saved`` one, whose data must be the
    same unless ``data_changed`` is allowed (then the head's rows are kept)."""
    pairs = ((ids.astype(np.int64), mask.astype(np.int64)) for ids, mask in
             zip(train_ds.input_ids, train_ds.loss_mask))
    counts = token_counts(pairs, vocab_size)  # [vocab] loss-masked occurrences
    vocab, notes = build_draft_vocab(counts, vocab_size, size), []
    if init is not None:  # the head's rows belong to its vocabulary: a fine-tune keeps it
        own, ids = vocab, init.draft_ids
        vocab = DraftVocab.from_draft_ids(ids, vocab_size, counts[ids], int(counts.sum()))
        if not torch.equal(ids, own.draft_ids):
            notes.append(f"kept the --init head's draft vocabulary: it covers {100 * vocab.coverage():.2f} % "
                         f"of this data's loss tokens (one built from this data: {100 * own.coverage():.2f} %)")
    if saved is not None:  # the checkpoint's vocabulary, if the data is the same
        same = saved.target_vocab_size == vocab_size and saved.total == int(counts.sum()) \
            and torch.equal(saved.counts, counts[saved.draft_ids])
        if not same and not data_changed:  # an allowed change of data keeps the head's rows
            check_same(saved, vocab)  # the clearer message where the vocabulary itself moved
            raise UserError("the training data differs from the checkpoint's (its loss-token counts): resume "
                            "with the same --data, or train into a new --out")
        vocab = saved
    return vocab, notes
