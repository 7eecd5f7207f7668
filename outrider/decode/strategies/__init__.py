"""Strategies around the reference step (``SpecEngine.step``): the same pieces, fewer host waits.

Contract: ``choose(engine, target)`` returns what advances a ``RequestState`` by one host
synchronisation, and every choice emits exactly what ``engine.step`` emits (the suite compares
them on the CPU in float32):

- ``GreedyChunks`` (plain greedy decoding): several target steps back to back on the device, each
  feeding its own argmax to the next, EOS checked once per chunk (``ar_chunks``);
- ``PipelinedStep`` (a ``device_side`` proposer over a static cache, chains or trees): the next
  draft is launched behind the verification, before the host reads its outcome (``pipelined``);
- ``RoundChunks`` (greedy chains, a ``device_rounds`` proposer): after one pipelined step, whole
  rounds (verify, accept, commit, draft) on the device, several per synchronisation (``rounds``);
- otherwise the reference step itself.
All of them verify, commit and observe through ``decode.round``.
"""

from __future__ import annotations

from typing import Any, Callable

from outrider.decode.runner import CachedLM
from outrider.decode.state import RequestState
from outrider.decode.strategies.ar_chunks import GreedyChunks
from outrider.decode.strategies.pipelined import PipelinedStep
from outrider.decode.strategies.rounds import RoundChunks


def choose(engine: Any, target: CachedLM) -> Callable[[RequestState], None]:
    """The strategy for ``engine`` (a ``SpecEngine``) decoding over ``target`` this call."""
    if engine.proposer is None and engine.sampling.greedy:
        return GreedyChunks(target, engine.AR_CHUNK)
    proposer = engine.proposer
    if proposer is None or not (target.cache.static and proposer.device_side):
        return lambda state: engine.step(state, target)
    first = PipelinedStep(engine, target)
    if engine.rounds_apply():
        return RoundChunks(engine, target, first)
    return first
