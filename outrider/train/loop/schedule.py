"""The learning-rate schedule: linear warm-up, then a cosine to ``min_lr_ratio`` over the steps or
the time budget, whichever runs out first. Pure arithmetic on a ``TrainConfig``; the optimizer's
``LambdaLR`` calls it (``outrider.train.loop.trainer``)."""

from __future__ import annotations

import math

from outrider.config import TrainConfig


def lr_factor(step: int, config: TrainConfig, budget_used: float = 0.0) -> float:
    """Multiplier of ``lr`` for the optimizer step after ``step`` completed ones.

    Linear warm-up, then a cosine whose progress is the larger of the steps done after warm-up
    and ``budget_used`` (the fraction of ``time_budget_s`` spent): a run stopped by its time
    budget still anneals to ``min_lr_ratio`` as it ends.
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min(max((step - config.warmup_steps) / span, budget_used), 1.0)
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
