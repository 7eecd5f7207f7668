"""Greedy speculative rounds that run on the device back to back, a chunk per host synchronisation.

Contract. ``DeviceRounds(target, proposer, batch, k)`` binds a ``CachedLM`` over a static slot
cache (``read_len="max"``: slot arithmetic on the device) and a ``device_side`` proposer that offers
``propose_device(k)`` (plain device operations, no graph replay of its own). One *round* is

    verify   the target's forward over [last, d_1..d_k] in slots ptr..ptr+k, greedy acceptance
             (``verify.accept_greedy``, the reference step's rule), rows not ``active`` accept
             nothing and emit nothing;
    commit   the accepted slots become valid, the rows' lengths grow, ptr advances on the device
             past the last slot any row keeps (1 + the most accepted drafts): the next round's
             verification overwrites the rejected slots after it (at batch 1 a round takes as
             many slots as it emits tokens; the slots of a row that kept fewer stay masked);
    record   (accepted count, drafted count, the k+1 verified tokens) into a device buffer;
    draft    ``proposer.observe`` then ``proposer.propose_device(k)`` for the next round.

``run(rounds)`` queues that many rounds without reading anything back and returns the records
``[batch, rounds, 2 + k+1]`` (on the device; the caller reads them once and hands them to
``settle``, which brings the host's copy of the first free slot up to the device's). The tokens are exactly
those the reference step (``SpecEngine.step``) emits: the same operations in the same order.
On CUDA with ``graphs=True`` a round is captured once as two CUDA graphs, replayed back to back:
the verification (the target's step, the acceptance, the commit) and the draft (the head's whole
chain); two rather than one so that each can be timed with events between them. Elsewhere the
round runs eagerly. When the target's step is compiled, so is the acceptance with its commit
(``accept_round``). ``RoundChunks`` is the engine's strategy: one pipelined step (its draft is
the first round's), then chunks of rounds, each never running past what the longest remaining
request can still need (a round emits at most k+1 tokens).
A row that stops inside a chunk (EOS, length) keeps running to the chunk's end: the caller ignores
its later records, and its extra cache entries are never read by another row.

Not done here: sampling (its random draws and residual distributions stay on the per-step path),
trees, proposers that need the host (n-gram).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from outrider.ops.graphs import (
    CompileOptions,
    capture_graph,
    compiled,
    graph_kernels,
)
from outrider.decode.draft import Draft
from outrider.decode.proposers.base import Proposer
from outrider.decode.round import Round, accepted_of, keep_of, observe, record_of
from outrider.decode.runner import CachedLM
from outrider.decode.state import RequestState
from outrider.decode.verify import VerifyResult, accept_greedy


def accept_round(logits: torch.Tensor, draft: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor,
                 depths: torch.Tensor, active: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
                 lengths: torch.Tensor, ptr: torch.Tensor, records: torch.Tensor, counter: torch.Tensor,
                 last: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Greedy acceptance of one round and its commit, in place: (num, accepted, tokens, path).

    logits [batch, k+1, vocab] the verification's; draft [batch, k]; parents [k], anc [1, k, k],
    depths [1, k]: the chain's structure (``Draft.chain``); active [batch] bool; slots [k+1] the
    round's cache slots; valid [batch, max_len], lengths [batch], ptr [1]: the slot cache's state;
    records [batch, R, 2 + k+1] and counter [1]: the round records; last [batch] the next round's
    first token. The acceptance, kept slots and record are the reference step's (``verify``,
    ``round``); one function so that a compiled target step gets a compiled acceptance too (a
    dozen small kernels fused into a few).
    """
    k = draft.shape[1]
    num = torch.where(active, k, 0)  # [batch] long: drafted tokens that count
    res = accept_greedy(draft, parents, anc, depths, num, logits, k)
    n_acc = accepted_of(res, active)  # [batch]
    keep = keep_of(res, k, active)  # [batch, k+1]
    valid.index_copy_(1, slots, keep)
    lengths.add_(keep.sum(dim=1))
    ptr.add_(n_acc.max() + 1)  # reuse the slots no row kept
    records.index_copy_(1, counter, record_of(n_acc, num, res.tokens)[:, None])
    counter.add_(1)
    last.copy_(res.tokens.gather(1, n_acc[:, None])[:, 0])
    return num, res.num_accepted, res.tokens, res.path


@functools.cache
def _compiled_accept(options: CompileOptions) -> Callable:
    return compiled(accept_round, options)


class DeviceRounds:
    """One batch's device-side round: static buffers, and its CUDA graph once captured."""

    def __init__(self, target: CachedLM, proposer: Proposer, batch: int, k: int, max_rounds: int, graphs: bool):
        dev = target.device
        self.target, self.proposer, self.k, self.max_rounds = target, proposer, k, max_rounds
        self.anchor = proposer.device_anchor()  # the graph writes into its buffers
        self.graphs = graphs and dev.type == "cuda"
        self.last = torch.zeros(batch, dtype=torch.long, device=dev)  # [batch] the token each row feeds first
        self.draft = torch.zeros(batch, k, dtype=torch.long, device=dev)  # [batch, k] the round's draft
        self.shape = Draft.chain(self.draft, torch.full((batch,), k, device=dev))  # its tree structure
        self.active = torch.ones(batch, dtype=torch.bool, device=dev)  # [batch] rows still generating
        self.records = torch.zeros(batch, max_rounds, k + 3, dtype=torch.long, device=dev)  # [batch, R, 2+k+1]
        self.counter = torch.zeros(1, dtype=torch.long, device=dev)  # next record index
        self._graphs: tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph] | None = None  # verify, draft
        # the acceptance and commit, fused by torch.compile when the target's step is compiled
        options = target.compile_options
        self._accept = accept_round if options is None else _compiled_accept(options)

    def key_matches(self, target: CachedLM, proposer: Proposer, batch: int, k: int, max_rounds: int) -> bool:
        return (self.target is target and self.proposer is proposer and self.anchor is proposer.device_anchor()
                and self.last.shape[0] == batch and self.k == k and self.max_rounds >= max_rounds)

    def load(self, last: torch.Tensor, draft: torch.Tensor, active: torch.Tensor) -> None:
        # last: [batch]; draft: [batch, k]; active: [batch] bool
        self.last.copy_(last)
        self.draft.copy_(draft)
        self.active.copy_(active)

    def _verify(self) -> tuple[torch.Tensor, ...]:
        """Verify, commit and record one round: (num, accepted, tokens, path, aux) for ``_draft``."""
        cache, k = self.target.cache, self.k
        slots = cache.write_slots  # the persistent width-(k+1) slot buffer of begin(k+1)
        torch.add(cache.arange[:k + 1], cache.ptr_dev, out=slots)
        ids = torch.cat([self.last[:, None], self.draft], dim=1)  # [batch, k+1]
        logits, aux = self.target.step_body(ids)  # [batch, k+1, vocab], [batch, k+1, n_aux * H]
        shape = self.shape
        num, n_acc, tokens, path = self._accept(logits, self.draft, shape.parents, shape.ancestors, shape.depths,
                                                self.active, slots, cache.valid, cache.lengths, cache.ptr_dev,
                                                self.records, self.counter, self.last)
        return num, n_acc, tokens, path, aux

    def _draft(self, num: torch.Tensor, n_acc: torch.Tensor, tokens: torch.Tensor, path: torch.Tensor,
               aux: torch.Tensor) -> None:
        """Feed the round's outcome to the proposer (``round.observe``) and draft the next round."""
        done = Round(Draft.chain(self.draft, num), VerifyResult(n_acc, tokens, path), self.active)
        observe(self.proposer, done, aux, self.active)
        self.draft.copy_(self.proposer.propose_device(self.k))

    def _state(self) -> Sequence[torch.Tensor]:
        cache = self.target.cache
        return (cache.valid, cache.lengths, cache.ptr_dev, self.last, self.draft, self.counter,
                *self.proposer.device_state())

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]:
        """Capture the round as two graphs (verification, draft) so that each can be timed; every
        warm-up leaves the state tensors as they were."""
        state = self._state()
        saved = [t.clone() for t in state]

        def restore():
            for dst, src in zip(state, saved):
                dst.copy_(src)

        dev = self.target.device
        with graph_kernels(self.target.model, self.target.slot_attention):  # the kernels the target's own graphs use
            verify, outputs = capture_graph(self._verify, dev, warmups=3, after_each=restore)
            restore()
            verify.replay()  # the draft's warm-up reads real outputs of a verification
            draft, _ = capture_graph(lambda: self._draft(*outputs), dev, warmups=3)
        restore()
        self._outputs = outputs  # the draft graph reads them: kept alive with the graphs
        return verify, draft

    @torch.no_grad()
    def run(self, rounds: int, mark: Callable[[str], None] | None = None) -> torch.Tensor:
        """Queue ``rounds`` rounds; returns their records ``[batch, rounds, 2 + k+1]`` (device).

        ``mark(name)`` is called before each round's verification ("verify") and its draft
        ("propose"), for timing without a host synchronisation (``state.Marks``).
        """
        cache, k = self.target.cache, self.k
        if not 1 <= rounds <= self.max_rounds:
            raise ValueError(f"rounds must be in 1..{self.max_rounds}, got {rounds}")
        if cache.ptr + rounds * (k + 1) > cache.max_len:
            raise RuntimeError(f"KV cache full: {cache.ptr} + {rounds} x {k + 1} slots > max_len {cache.max_len}")
        mark = mark or (lambda name: None)
        cache.begin(k + 1)  # the slot buffer and ptr_dev for this chunk
        self.counter.zero_()
        if self.graphs and self._graphs is None:
            self._graphs = self._capture()
        for _ in range(rounds):
            mark("verify")
            if self._graphs is not None:
                self._graphs[0].replay()
                mark("propose")
                self._graphs[1].replay()
            else:
                outputs = self._verify()
                mark("propose")
                self._draft(*outputs)
        cache.n_pending = 0
        return self.records[:, :rounds]

    def settle(self, records: list[list[list[int]]]) -> None:
        """The host's first free slot after the rounds whose records ``run`` returned, read back
        ([batch][round][accepted, drafted, k+1 tokens]): each round advanced it past the last slot
        any row kept, as ``accept_round`` did on the device."""
        self.target.cache.ptr += sum(max(row[r][0] for row in records) + 1 for r in range(len(records[0])))


class RoundChunks:
    """The engine's strategy: ``first`` (a ``PipelinedStep``) once, then up to ``engine.rounds``
    rounds per host synchronisation; a row that stops inside a chunk ignores its later rounds."""

    def __init__(self, engine: Any, target: CachedLM, first: Callable[[RequestState], None]):
        self.engine, self.target, self.first = engine, target, first  # engine: the ``SpecEngine``
        self.runner: DeviceRounds | None = None

    def __call__(self, state: RequestState) -> None:
        if self.first is not None:  # the first step drafts from the prompt; then whole rounds
            self.first(state)
            self.draft, self.first = self.first.next, None
            return
        engine, B, k = self.engine, state.batch, state.k
        n = max(1, min(engine.rounds, -(-state.tokens_left() // (k + 1))))
        active = state.active_rows()  # [batch] bool
        if self.runner is None:
            runner = engine.rounds_pool.get((B, k))
            if runner is None or not runner.key_matches(self.target, engine.proposer, B, k, engine.rounds):
                runner = DeviceRounds(self.target, engine.proposer, B, k, engine.rounds, engine.graphs)
                if engine.graphs:  # kept with its graph; elsewhere caches are not reused either
                    engine.rounds_pool[(B, k)] = runner
            self.runner = engine.rounds_runner = runner
            runner.load(state.last, self.draft.tokens, active)
            self.draft = None
        else:
            self.runner.active.copy_(active)
        host = self.runner.run(n, state.marks.mark).tolist()  # [batch][round][n_acc, num, k+1 tokens]
        self.runner.settle(host)
        state.marks.mark("observe")
        for r in range(n):
            if not state.any_alive():
                break
            state.record([row[r] for row in host], k)
        state.last = self.runner.last
