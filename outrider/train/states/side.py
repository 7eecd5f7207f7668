"""``TargetSide``: what the trainer reads of the target, whichever way it comes.

Contract: three implementations, ``features.OnlineTarget`` (the target in memory),
``features.CachedTarget`` (a hidden-state cache, ours or a peer's) and ``stream_train.StreamedOnline``
(the target streamed layer by layer), opened by ``features.open_target`` or ``StreamedOnline``.
The trainer (``outrider.train.loop.trainer``) types against this protocol only.

Not done here: opening a side (``features``, ``stream_train``), the loss, the loop.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from outrider.train.data.datasets import Batch, BatchCursor, TokenDataset
    from outrider.train.states.capture import Captured


class FeatureSource(AbstractContextManager, Protocol):
    """Bound for a run: each training or evaluation ``Batch`` -> its aux states and teacher."""

    def features(self, batch: Batch) -> Captured:
        """``Captured(aux [B, S, 3H], teacher [B, S, draft_vocab])`` for ``batch``."""


class TargetSide(Protocol):
    """The target as the trainer sees it: config, data splits, embedding, costs and features."""

    config: Any  # the target's config, object or dict
    aux_layer_ids: tuple[int, ...] | None  # fixed by a cache or a streamed target; None: any
    splits: dict[str, TokenDataset | None]  # "train" and "eval" (None: no eval split)
    embedding: torch.nn.Module  # the target's frozen input embedding
    notes: list[str]  # what the run's summary should say about this side

    def lm_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """lm_head rows of the target ids ``ids`` [n] -> [n, H] (None: the model has no lm_head)."""

    def norm_weight(self) -> torch.Tensor | None:
        """The target's final norm weight [H], if it has one."""

    def last_layer(self) -> torch.nn.Module | None:
        """The target's last decoder layer, where it stays in memory."""

    def flops_per_token(self, extra: int) -> float:
        """Matmul FLOPs per training token on this side (``extra``: the teacher's multiply-adds)."""

    def attention_flops(self, pairs: int) -> float:
        """Attention FLOPs of the target's forward over ``pairs`` causal (query, key) pairs."""

    def follow(self, cursor: BatchCursor) -> Any:
        """The cursor the run draws batches from (a side that reads ahead wraps ``cursor``)."""

    def feature_source(self, aux_layer_ids: Sequence[int], vocab: Any, cfg: Any) -> FeatureSource:
        """The run's features: ``aux_layer_ids`` captured, the teacher over ``vocab``'s draft rows."""
