"""The proposer protocol that ``SpecEngine`` drives.

Contract: the engine calls ``start(ctx)`` once after the target's prefill, then per step
``propose(k) -> Draft`` (``decode.draft``: a chain of k tokens per row, possibly fewer real ones;
a proposer with a ``tree`` drafts trees of its own shape) and, after verification,
``observe(outcome)``. A proposer never sees the target's logits of future positions, and it
never changes what the verifier emits: it only proposes. Probabilities ``q`` are returned when
the proposer sampled from a distribution; a deterministic proposer returns ``q=None`` and is
verified as a point mass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from outrider.decode.draft import Draft
from outrider.decode.sampling import SamplingParams
from outrider.ops.graphs import CompileOptions, compiled


@dataclass
class StartContext:
    histories: list[list[int]]  # per row: prompt + emitted tokens, kept current by the engine
    prompt_lens: torch.Tensor  # [batch]
    last: torch.Tensor  # [batch] the first emitted token (not yet in any cache)
    sampling: SamplingParams
    max_len: int  # cache slots a proposer's own cache needs for this request batch
    target_aux: torch.Tensor | None = None  # [batch, W >= P, n_aux*hidden] aux states of the prompt (right-padded)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    graphs: bool = False  # the engine replays CUDA graphs; a proposer may capture its own steps too
    compile: CompileOptions | None = None  # the engine fuses its step with torch.compile under these; so may a proposer


@dataclass
class Outcome:
    draft: Draft
    num_accepted: torch.Tensor  # [batch]
    tokens: torch.Tensor  # [batch, D+1]; row b emitted tokens[b, :num_accepted[b]+1] (a chain: D = k)
    active: torch.Tensor  # [batch] bool, rows still generating after this step (during it, for device_side)
    # [batch, D+1, n_aux*hidden] aux at the root and the accepted path's nodes (past its end: the root's)
    target_aux: torch.Tensor | None = None


class Proposer:
    """Base class: subclasses implement ``propose`` and, if stateful, ``start``/``observe``."""

    name = "base"
    aux_layer_ids: tuple[int, ...] | None = None  # set when the proposer needs target hidden states
    # True: observe/propose use device tensors only, so the engine may call them before the host
    # has read the step's outcome (``Outcome.active`` is then the rows active during the step)
    device_side = False
    # True: ``propose_device`` drafts greedily with plain device operations (no graph replay, no
    # host value), so the engine may run whole rounds on the device (``decode.strategies.rounds``)
    device_rounds = False
    tree = None  # a draft tree's spec (``outrider.trees``: TreeBudget or StaticTree); None: chains

    def round_shape(self, k: int) -> tuple[int, int]:
        """(nodes verified, greatest depth) of a round drafted with ``k``: a chain's (k, k)."""
        return k, k

    @classmethod
    def build(cls, target: torch.nn.Module, draft: object = None, **options: object) -> "Proposer":
        """The registry's constructor (``proposers.PROPOSERS``): ``draft`` is what the method needs,
        built by the caller (a model, a head); ``options`` the method's own settings."""
        return cls()

    def start(self, ctx: StartContext) -> None:
        self.ctx = ctx

    def fused(self, options: CompileOptions | None, *fns: Callable) -> tuple[Callable, ...]:
        """``fns`` as they are (``options`` None: eager), or compiled by ``torch.compile`` under
        ``options``, once per proposer, options and role (a role is known by its function's name)."""
        if not options:
            return fns
        variants = self.__dict__.setdefault("_fused", {})  # (options, role name) -> the compiled role
        for f in fns:
            if (options, f.__name__) not in variants:
                variants[options, f.__name__] = compiled(f, options)
        return tuple(variants[options, f.__name__] for f in fns)

    def propose(self, k: int) -> Draft:
        raise NotImplementedError

    def observe(self, outcome: Outcome) -> None:
        return None

    def propose_device(self, k: int) -> torch.Tensor:
        """Greedy draft tokens [batch, k] from device operations alone (``device_rounds`` proposers)."""
        raise NotImplementedError

    def device_state(self) -> list[torch.Tensor]:
        """Tensors that ``observe`` and ``propose_device`` update in place (restored after a graph's warm-up)."""
        return []

    def device_anchor(self) -> object:
        """An object whose identity changes when the buffers ``propose_device`` writes are reallocated."""
        return self

    def close(self) -> None:
        return None
