"""CUDA event timing shared by the benchmark scripts: the median of timed calls after warm-up."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], reps: int = 5, warm: int = 2) -> float:
    """Milliseconds of one ``fn()`` on the current CUDA stream: the median over ``reps`` calls
    timed by events, after ``warm`` untimed calls."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
