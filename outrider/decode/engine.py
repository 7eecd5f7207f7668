"""SpecEngine: one code path for plain autoregressive and speculative decoding.

Contract: prefill, then per step the method's definition (``SpecEngine.step``):

    propose   a ``Draft`` per row (``proposers``; none for plain decoding): a chain of k, or a tree
    verify    one target forward over the root and the nodes ([last, d_1..d_k] for a chain; a
              tree's under its ancestry mask, at the root's position plus their depth), then one
              verification, greedy or rejection sampling, for chains and trees alike (``verify``)
    commit    the accepted path's slots of the target's cache; rejected ones stay masked (``kv_cache``)
    observe   emit and count per row (``state.RequestState``), feed the outcome to the proposer
              (verify, commit and observe: ``round``, which every strategy shares)

With no proposer the same step is plain autoregressive decoding, so the baseline and the
speculative run share every line that is not speculation. Greedy output equals greedy decoding
of the target token for token (exact in float32 on the CPU in our tests); sampled output follows
the processed target distribution. Rows accept different numbers of tokens and stop
independently at EOS or ``max_new_tokens``. Faster strategies (``strategies``: plain greedy chunks,
a draft pipelined behind verification, whole rounds on the device) wrap the same pieces and emit
exactly what ``step`` emits; the engine picks one per call. ``graphs=True`` (CUDA) replays each
target forward width as a CUDA graph; ``compile=True`` fuses the target step with ``torch.compile``.
Either way the target's cache and graphs are kept for reuse, for the ``POOLED_SHAPES`` batch sizes
used last (a run of many batch sizes, as regeneration's last batch of each chunk, holds no more).

Not done here: continuous batching (requests join only at prefill), prompt caching, device
rounds for trees (a tree round is the reference step, or pipelined).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from outrider.ops.graphs import CompileOptions, compile_options
from outrider.decode.kv_cache import static_cache
from outrider.decode.draft import Draft
from outrider.decode.proposers.base import Proposer, StartContext
from outrider.decode.round import observe, verify_round
from outrider.decode.runner import PROMPT_BUCKET, CachedLM, cached_lm_read_len, prefill_graphs_apply
from outrider.decode.sampling import SamplingParams, probs, sample
from outrider.decode.state import GenerationResult, RequestState
from outrider.decode.strategies import choose
from outrider.decode.strategies.rounds import DeviceRounds
from outrider.errors import UserError, require

POOLED_SHAPES = 4  # graphs or compile: target caches (each its KV slots and graphs) kept for this many batch sizes


def eos_token_ids(model: torch.nn.Module, tokenizer=None) -> tuple[int, ...]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


class SpecEngine:
    """Decode a batch of prompts with an optional proposer.

    target: a stock Hugging Face causal LM (eval mode); proposer: None for plain decoding;
    k: draft tokens per step (``generate(..., k=)`` overrides it for one call).
    """

    AR_CHUNK = 8  # plain greedy decoding: device steps per host synchronisation

    def __init__(self, target: torch.nn.Module, proposer: Proposer | None = None, k: int = 4,
                 sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = (),
                 read_len: str = "auto", graphs: bool = False, compile: bool | str | CompileOptions | None = False,
                 rounds: int = 8, attention: str = "slots"):
        # rounds: greedy speculation with a device_rounds proposer runs up to this many rounds per
        # host synchronisation on the device (0: one step per synchronisation, as other proposers)
        require(rounds >= 0, f"rounds must be >= 0, got {rounds}")
        # attention: "slots" (``slot_attention``) or "model" (the model's own) in captured steps
        require(attention in ("slots", "model"), f"attention must be 'slots' or 'model', got {attention!r}")
        if proposer is not None:
            require(k >= 1, f"k (draft tokens per step) must be >= 1, got {k}")
        self.target = target
        self.proposer = proposer
        self.k = k if proposer is not None else 0
        self.sampling = sampling
        self.eos = set(int(e) for e in eos_ids)
        self.read_len = read_len
        self.device = next(target.parameters()).device
        self.graphs = graphs and self.device.type == "cuda"
        self.compile = compile_options(compile)  # None: eager
        self.rounds = rounds
        self.attention = attention
        self._pool: dict[tuple, CachedLM] = {}  # graph mode: caches (and their graphs) reused per batch size
        self.rounds_pool: dict[tuple[int, int], DeviceRounds] = {}  # (batch, k) -> rounds (and their CUDA graph)
        self.rounds_runner: DeviceRounds | None = None  # the device rounds of the last call, if it ran any

    def step(self, state: RequestState, target: CachedLM) -> None:
        """One step, the method's definition: propose -> verify -> commit -> observe (``round``),
        for chains and trees alike."""
        active = state.active_rows()  # [batch] bool
        draft = self.propose(state, active)  # a chain of k tokens per row, or a tree
        state.marks.mark("verify")
        done = verify_round(target, state.last, draft, self.sampling, state.rand, active)
        # the step's one host synchronisation: the records and the last slot any row keeps
        host = torch.cat([done.record(), done.ends()[:, None]], dim=1).tolist()  # [batch][2 + D+1, 1]
        target.commit(done.keep(), used=max(row[-1] for row in host))
        state.record([row[:-1] for row in host], state.k)  # emit up to EOS / max_new_tokens, count
        if self.proposer is not None:
            state.marks.mark("observe")
            observe(self.proposer, done, target.aux, state.active_rows())
        state.last = done.last

    def propose(self, state: RequestState, active: torch.Tensor) -> Draft:
        """The step's draft: the proposer's chain of ``state.k`` tokens, none for rows not ``active``."""
        B = state.batch
        if self.proposer is None:
            state.marks.mark("propose")
            none = torch.zeros(B, 0, dtype=torch.long, device=self.device)
            return Draft.chain(none, torch.zeros(B, dtype=torch.long, device=self.device))
        state.marks.mark("prompt_draft" if state.result.steps == 0 else "propose")
        return self.masked(self.proposer.propose(state.k), active)

    @staticmethod
    def masked(draft: Draft, active: torch.Tensor) -> Draft:
        """``draft`` with no real tokens in the rows not ``active`` ([batch] bool)."""
        draft.num = torch.where(active, draft.num, torch.zeros_like(draft.num))
        return draft

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, k: int | None = None
                 ) -> GenerationResult:
        """New tokens per prompt; ``k`` draft tokens per step (default: the engine's)."""
        require(len(prompts) > 0, "no prompts given")
        require(all(len(p) > 0 for p in prompts), "empty prompt: give at least one token per prompt")
        require(max_new_tokens >= 1, f"max new tokens must be >= 1, got {max_new_tokens}")
        if k is not None and self.proposer is not None:
            require(k >= 1, f"k (draft tokens per step) must be >= 1, got {k}")
        k = (self.k if k is None else k) if self.proposer is not None else 0
        B, dev = len(prompts), self.device
        vocab = self.target.get_output_embeddings().weight.shape[0]
        bad = [t for p in prompts for t in p if not 0 <= int(t) < vocab]
        require(not bad, f"prompt token id {bad[:1]} outside the target vocabulary of {vocab}")
        # a round verifies `nodes` drafted tokens and accepts at most `steps` (a chain: k and k)
        nodes, steps = self.proposer.round_shape(k) if self.proposer is not None else (0, 0)
        state = RequestState(prompts, steps, max_new_tokens, self.eos, self.sampling.seed, dev)
        plens = state.prompt_lens
        P = int(plens.max())
        limit = getattr(self.target.config, "max_position_embeddings", None)
        if limit and P + max_new_tokens > limit:
            raise UserError(f"prompt ({P}) + max new tokens ({max_new_tokens}) exceed the target's "
                            f"{limit} positions: shorten the prompt or ask for fewer tokens")
        # graphs: prompts padded to a few widths, each one's forward replayed as a graph (padding invalid)
        width = min(-(-P // PROMPT_BUCKET) * PROMPT_BUCKET, limit or P + PROMPT_BUCKET)
        if not (self.graphs and prefill_graphs_apply(self.target, B, width)):
            width = P
        max_len = max(P + self._decode_slots(B, nodes, max_new_tokens) + 1, width)
        aux_ids = self.proposer.aux_layer_ids if self.proposer is not None else None
        target = self._target_lm(B, max_len, aux_ids)
        result = state.result
        self.rounds_runner = None
        try:
            t0 = self.clock()
            ids = torch.zeros(B, width, dtype=torch.long, device=dev)
            for b, p in enumerate(prompts):
                ids[b, :len(p)] = torch.tensor([int(t) for t in p], device=dev)
            valid = torch.arange(width, device=dev)[None, :] < plens[:, None]  # [batch, width]
            ends, which = torch.unique(plens - 1, return_inverse=True)  # last prompt index per row
            logits = target.forward(ids, query_valid=valid, logits_at=ends)  # [batch, len(ends), vocab]
            target.commit(valid)
            state.last = self._first_token(logits[torch.arange(B, device=dev), which], state)  # [batch]
            for b, t in enumerate(state.last.tolist()):
                state.emit(b, [t])
            result.prefill_s = self.clock() - t0
            if self.proposer is not None:
                self.proposer.start(StartContext(
                    histories=state.histories, prompt_lens=plens, last=state.last, sampling=self.sampling,
                    max_len=max_len, target_aux=target.aux, device=dev, graphs=self.graphs, compile=self.compile))
            t_dec = time.perf_counter()
            advance = choose(self, target)
            while state.any_alive():
                advance(state)
            state.marks.mark("end")
            result.decode_s = self.clock() - t_dec
            spans = state.marks.totals()
            result.prompt_draft_s = spans.get("prompt_draft", 0.0)
            result.propose_s = spans.get("propose", 0.0) + result.prompt_draft_s
            result.verify_s = spans.get("verify", 0.0)
        finally:
            if not (self.graphs or self.compile):
                target.close()
            if self.proposer is not None:
                self.proposer.close()
        return result

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to wait for off CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def clock(self) -> float:
        self.sync()
        return time.perf_counter()

    def rounds_apply(self) -> bool:
        """Device rounds, given a static cache: greedy, and a proposer that drafts on the device alone."""
        return (self.rounds > 0 and self.sampling.greedy and getattr(self.proposer, "device_rounds", False)
                and getattr(self.proposer, "device_side", False) and self.proposer.tree is None)

    def _first_token(self, logits: torch.Tensor, state: RequestState) -> torch.Tensor:
        # logits: [batch, vocab]
        if self.sampling.greedy:
            return logits.argmax(-1)
        return sample(probs(logits, self.sampling), state.rand.uniform(1, logits.device)[:, 0])

    def _target_lm(self, B: int, max_len: int, aux_ids) -> CachedLM:
        if not (self.graphs or self.compile):
            return CachedLM(self.target, B, max_len, aux_layer_ids=aux_ids, read_len=self.read_len)
        key = (B, tuple(aux_ids or ()))
        lm = self._pool.pop(key, None)
        if lm is None or lm.cache.max_len < max_len:
            if lm is not None:
                self._drop(lm)
            lm = CachedLM(self.target, B, -(-max_len // 512) * 512, aux_layer_ids=aux_ids, graphs=self.graphs,
                          compile=self.compile, attention=self.attention)
        while len(self._pool) >= POOLED_SHAPES:  # the least recently used goes
            self._drop(self._pool.pop(next(iter(self._pool))))
        self._pool[key] = lm  # the most recently used last
        lm.reset()
        return lm

    def release(self) -> None:
        """Let go of every pooled target cache and device round (their KV slots and graphs), as after
        a failed allocation: the next call builds what it needs again."""
        for lm in self._pool.values():
            self._drop(lm)
        self._pool.clear()
        self.rounds_pool.clear()
        self.rounds_runner = None

    def _drop(self, lm: CachedLM) -> None:
        """Close a target cache the pool lets go, and forget the device rounds built on it (they hold it)."""
        lm.close()
        for rounds_key in [r for r, runner in self.rounds_pool.items() if runner.target is lm]:
            del self.rounds_pool[rounds_key]

    def _decode_slots(self, B: int, k: int, max_new: int) -> int:
        """Cache slots a request's decoding may take after its prompt. A step takes k+1 slots (its
        rejected ones stay masked); device rounds reuse them, so that the rounds take at most the
        tokens each row verifies: up to ``max_new`` + k, plus the rest of the chunk in which the
        row stopped (``DeviceRounds.settle``'s accounting, summed over the rows)."""
        per_step = (max_new + 1) * (k + 1)
        static = static_cache(cached_lm_read_len(self.read_len, self.device, self.graphs, self.compile), self.device)
        if not (static and self.rounds_apply()):
            return per_step
        per_row = max_new + k + (self.rounds - 1) * (k + 1)
        return (k + 1) + min(B * per_row, per_step)  # the first step, then the rounds
