"""The reference step with the next draft launched behind the verification.

Contract: for a proposer that needs nothing from the host (``device_side``: its ``observe`` and
``propose`` use device tensors only) over a static cache (whose spare slots absorb a commit that
does not know how many drafts were accepted), ``PipelinedStep`` queues verify, commit, observe and
the next ``propose`` before the host reads the step's outcome, so the host's bookkeeping overlaps
the draft. ``Outcome.active`` is then the rows active during the step. It emits exactly what
``SpecEngine.step`` emits; ``next`` is the draft launched for the following step.
"""

from __future__ import annotations

from typing import Any

import torch

from outrider.decode.proposers.base import Draft, Outcome
from outrider.decode.runner import CachedLM
from outrider.decode.state import RequestState
from outrider.decode.verify import verify


class PipelinedStep:
    def __init__(self, engine: Any, target: CachedLM):
        self.engine, self.target = engine, target  # engine: the ``SpecEngine``
        self.next: Draft | None = None  # launched at the end of the previous step

    def __call__(self, state: RequestState) -> None:
        engine, target, proposer = self.engine, self.target, self.engine.proposer
        B, k, marks, dev = state.batch, state.k, state.marks, engine.device
        active = state.active_rows()  # [batch] bool
        if self.next is None:
            draft = engine.propose(state, active)
        else:
            draft, self.next = engine.masked(self.next, active), None
        marks.mark("verify")
        logits = target.forward(torch.cat([state.last[:, None], draft.tokens], dim=1))  # [batch, k+1, vocab]
        res = verify(draft, logits, engine.sampling, state.rand)
        n_acc = torch.where(active, res.num_accepted, torch.zeros_like(res.num_accepted))  # [batch]
        packed = torch.cat([n_acc[:, None], draft.num[:, None], res.tokens], dim=1)  # [batch, 2 + k+1]
        keep = (torch.arange(k + 1, device=dev)[None, :] <= n_acc[:, None]) & active[:, None]
        on_host = packed.to("cpu", non_blocking=True)  # on CUDA a copy queued behind the step
        ready = torch.cuda.Event() if dev.type == "cuda" else None
        if ready is not None:
            ready.record()
        target.commit(keep, used=k + 1)  # slots past the accepted ones stay masked: no host value needed
        marks.mark("observe")
        proposer.observe(Outcome(draft, n_acc, res.tokens, active, target.aux))
        marks.mark("propose")
        self.next = proposer.propose(k)
        if ready is not None:
            ready.synchronize()
        state.record(on_host.tolist(), k)
        state.last = res.tokens[torch.arange(B, device=dev), n_acc]
