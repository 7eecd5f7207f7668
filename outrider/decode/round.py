"""One speculative round's verify -> commit -> observe, shared by the reference step and every
strategy (``SpecEngine.step``, ``strategies.pipelined``, ``strategies.rounds``), chains and trees alike.

Contract:
- ``verify_round(target, last, draft, sampling, rand)``: the target's one forward over the root
  (``last``, the row's last committed token) and the draft's N nodes (``CachedLM.verify``: a chain
  as the plain causal step, a tree at the root's position plus depth under its ancestry mask,
  both read from the ``Draft``), then ``verify.verify`` -> a ``Round``.
- ``Round``: the draft, its ``VerifyResult`` and the rows ``active`` during it (inactive rows accept
  nothing and keep nothing): ``accepted`` [batch], ``keep`` [batch, 1 + N] (the cache positions
  kept: the root and the accepted path), ``record`` [batch, 2 + D+1] (accepted, drafted, the D+1
  tokens: what ``RequestState.record`` takes), ``last`` [batch] (the next root) and ``used`` (the
  slots a commit releases after, from the host copy of ``record`` and ``ends``).
- ``observe(proposer, round, aux, active)``: the ``Outcome`` a proposer sees: the round's tokens and
  the target's aux states along the accepted path (past its end: the root's again).

Nothing here reads the device, so a strategy decides where its one host synchronisation goes.
Not done here: drafting, emitting and counting (``state``), the order of the pieces (strategies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.decode.draft import Draft
from outrider.decode.proposers.base import Outcome, Proposer
from outrider.decode.runner import CachedLM
from outrider.decode.sampling import RowRandom, SamplingParams
from outrider.decode.verify import VerifyResult, verify


def accepted_of(result: VerifyResult, active: torch.Tensor) -> torch.Tensor:
    """[batch] accepted nodes, 0 for rows not ``active`` ([batch] bool)."""
    return torch.where(active, result.num_accepted, 0)


def keep_of(result: VerifyResult, n_nodes: int, active: torch.Tensor) -> torch.Tensor:
    """[batch, 1 + N] bool: the verified positions the target's cache keeps (none in inactive rows)."""
    return result.keep(n_nodes) & active[:, None]


def record_of(accepted: torch.Tensor, drafted: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, 2 + D+1] long, what ``RequestState.record`` reads: accepted [batch], drafted [batch],
    the tokens [batch, D+1]."""
    return torch.cat([accepted[:, None], drafted[:, None], tokens], dim=1)


@dataclass
class Round:
    draft: Draft
    result: VerifyResult
    active: torch.Tensor  # [batch] bool, rows generating during the round

    @property
    def accepted(self) -> torch.Tensor:
        return accepted_of(self.result, self.active)  # [batch]

    def keep(self) -> torch.Tensor:
        return keep_of(self.result, self.draft.tokens.shape[1], self.active)  # [batch, 1 + N]

    def record(self) -> torch.Tensor:
        """[batch, 2 + D+1]: accepted, drafted (the deepest real node), the D+1 tokens."""
        return record_of(self.accepted, self.draft.drafted(), self.result.tokens)

    def ends(self) -> torch.Tensor:
        """[batch] 1 + the last verified position a row keeps (0 for inactive rows)."""
        return torch.where(self.active, self.result.end() + 1, 0)

    @property
    def last(self) -> torch.Tensor:
        """[batch] the token each row feeds next: its round's last emitted one."""
        return self.result.tokens.gather(1, self.accepted[:, None])[:, 0]


def verify_round(target: CachedLM, last: torch.Tensor, draft: Draft, sampling: SamplingParams, rand: RowRandom,
                 active: torch.Tensor) -> Round:
    """last: [batch] each row's root token; active: [batch] bool."""
    ids = torch.cat([last[:, None], draft.tokens], dim=1)  # [batch, 1 + N]
    if draft.is_chain():
        logits = target.verify(ids)  # [batch, 1 + N, vocab]
    else:
        logits = target.verify(ids, draft.offsets(), draft.verify_mask())
    return Round(draft, verify(draft, logits, sampling, rand), active)


def observe(proposer: Proposer | None, done: Round, aux: torch.Tensor | None, active: torch.Tensor) -> None:
    """Feed the round's outcome to ``proposer``; aux: [batch, 1 + N, n_aux * hidden] the target's
    aux states at the verified positions (or None); active: the rows the proposer treats as active."""
    if proposer is None:
        return
    along = None if aux is None else done.result.gather(aux)  # [batch, D+1, n_aux * hidden]
    proposer.observe(Outcome(done.draft, done.accepted, done.result.tokens, active, along))
