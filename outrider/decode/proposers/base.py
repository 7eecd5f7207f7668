"""The proposer protocol that ``SpecEngine`` drives.

Contract: the engine calls ``start(ctx)`` once after the target's prefill, then per step
``propose(k) -> Draft`` (a chain of k tokens per row, possibly fewer real ones; a proposer with a
``tree`` drafts trees of its own shape) and, after verification,
``observe(outcome)``. A proposer never sees the target's logits of future positions, and it
never changes what the verifier emits: it only proposes. Probabilities ``q`` are returned when
the proposer sampled from a distribution; a deterministic proposer returns ``q=None`` and is
verified as a point mass.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from outrider.ops.graphs import CompileOptions
from outrider.decode.sampling import SamplingParams


@functools.cache
def _chain_parents(n: int) -> torch.Tensor:
    return torch.arange(-1, n - 1)  # [n] on the host; shared: never written


@dataclass
class Draft:
    """A draft tree per row: node i's token is ``tokens[:, i]``, its parent ``parents[i]`` (-1: the
    root, the last committed token; parents precede children). A chain of k is the tree whose
    parents are i-1 (``Draft.chain``); EAGLE-2 trees choose their shape per row (``parents``
    ``[batch, N]``). ``depth`` is the tree's greatest depth (a chain's: k)."""

    tokens: torch.Tensor  # [batch, N] long; nodes >= num[b] are padding
    parents: torch.Tensor  # [N] long on the host, or [batch, N] on the device: each node's parent, -1 the root
    num: torch.Tensor  # [batch] long, real nodes per row
    q: torch.Tensor | None = None  # [batch, N, vocab] draft probabilities, or None (point mass)
    depth: int | None = None  # the greatest depth of a node (None: a chain, N)

    @classmethod
    def chain(cls, tokens: torch.Tensor, num: torch.Tensor, q: torch.Tensor | None = None) -> "Draft":
        """tokens: [batch, k]; num: [batch]; q: [batch, k, vocab] or None."""
        return cls(tokens, _chain_parents(tokens.shape[1]), num, q)

    def is_chain(self) -> bool:
        return self.parents.dim() == 1 and torch.equal(self.parents, _chain_parents(self.tokens.shape[1]))

    @property
    def levels(self) -> int:
        """The greatest depth of a node: the most tokens a round can accept."""
        return self.tokens.shape[1] if self.depth is None else self.depth


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
    tokens: torch.Tensor  # [batch, k+1]; row b emitted tokens[b, :num_accepted[b]+1]
    active: torch.Tensor  # [batch] bool, rows still generating after this step (during it, for device_side)
    target_aux: torch.Tensor | None = None  # [batch, k+1, n_aux*hidden] aux at the verify inputs


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
    tree = None  # a draft tree's shape (``ops.tree``: TreeBudget or StaticTree); None: chains

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
