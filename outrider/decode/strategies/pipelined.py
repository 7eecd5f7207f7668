"""The reference step with the next draft launched behind the verification.

Contract: for a proposer that needs nothing from the host (``device_side``: its ``observe`` and
``propose`` use device tensors only) over a static cache (whose spare slots absorb a commit that
does not know how many drafts were accepted), ``PipelinedStep`` queues verify, commit, observe and
the next ``propose`` before the host reads the step's outcome, so the host's bookkeeping overlaps
the draft. ``Outcome.active`` is then the rows active during the step. Chains and trees alike: the
verification, commit and observation are ``decode.round``'s, as the reference step's. It emits
exactly what ``SpecEngine.step`` emits; ``next`` is the draft launched for the following step.
"""

from __future__ import annotations

from typing import Any

import torch

from outrider.decode.draft import Draft
from outrider.decode.round import observe, verify_round
from outrider.decode.runner import CachedLM
from outrider.decode.state import RequestState


class PipelinedStep:
    def __init__(self, engine: Any, target: CachedLM):
        self.engine, self.target = engine, target  # engine: the ``SpecEngine``
        self.next: Draft | None = None  # launched at the end of the previous step

    def __call__(self, state: RequestState) -> None:
        engine, target, proposer = self.engine, self.target, self.engine.proposer
        marks, dev = state.marks, engine.device
        active = state.active_rows()  # [batch] bool
        if self.next is None:
            draft = engine.propose(state, active)
        else:
            draft, self.next = engine.masked(self.next, active), None
        marks.mark("verify")
        done = verify_round(target, state.last, draft, engine.sampling, state.rand, active)
        on_host = done.record().to("cpu", non_blocking=True)  # on CUDA a copy queued behind the step
        ready = torch.cuda.Event() if dev.type == "cuda" else None
        if ready is not None:
            ready.record()
        # slots past the kept ones stay masked: no host value needed
        target.commit(done.keep(), used=draft.tokens.shape[1] + 1)
        marks.mark("observe")
        observe(proposer, done, target.aux, active)
        marks.mark("propose")
        self.next = proposer.propose(state.k)
        if ready is not None:
            ready.synchronize()
        state.record(on_host.tolist(), state.k)
        state.last = done.last
