"""SpecEngine: one code path for plain autoregressive and speculative decoding.

Contract:
    prefill -> loop { propose k -> one target forward over k+1 positions -> verify ->
                      commit what was accepted -> feed the outcome back to the proposer }
With no proposer (or k = 0) the same loop is plain autoregressive decoding, so the baseline and
the speculative run share every line that is not speculation. Greedy output equals greedy
decoding of the target token for token (up to floating-point reassociation; exact in float32
on the CPU in our tests); sampled output follows the processed target distribution
(``verify.py``). Rows of a batch accept different numbers of tokens and stop independently at
an EOS token or at ``max_new_tokens``. A rejected token costs nothing: the slot cache keeps it
masked (``kv_cache.py``).

On CUDA, ``graphs=True`` replays each target forward width (1 for plain decoding, k+1 for
verification) as a CUDA graph over a static cache that is reused across calls, and lets the
proposer capture its own steps (EAGLE-3 does); prompts are padded to a multiple of 64 positions
and their forward replayed as a graph per width too (eager kernels; dense targets).
``compile=True`` fuses the target step with ``torch.compile`` first (on the CPU it runs compiled
without graphs). Plain greedy decoding needs no host decision between steps: it runs
``AR_CHUNK`` steps per synchronisation (one graph per step that feeds its own argmax back),
checking EOS once per chunk. A proposer that works on the
device alone (``device_side``, EAGLE-3) is pipelined on CUDA: the next draft is launched behind
the verification, before the host reads the outcome, so the host's bookkeeping overlaps it.
A greedy proposer that drafts with device operations alone (``device_rounds``, EAGLE-3) runs,
after that first step, whole rounds on the device: verification, acceptance, commit and the next
draft, ``rounds`` (8) rounds per synchronisation, replayed as two CUDA graphs (``spec_rounds.py``).
Captured steps attend with ``slot_attention`` (``attention="slots"``) or the model's own (``"model"``).

Not done here: continuous batching (requests join only at prefill), trees, prompt caching
across calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from outrider.decode.graphs import CompileOptions, compile_options
from outrider.decode.kv_cache import static_cache
from outrider.decode.proposers.base import Draft, Outcome, Proposer, StartContext
from outrider.decode.strategies.rounds import DeviceRounds
from outrider.decode.runner import (
    PROMPT_BUCKET,
    CachedLM,
    cached_lm_read_len,
    prefill_graphs_apply,
)
from outrider.decode.sampling import RowRandom, SamplingParams, probs, sample
from outrider.decode.verify import verify_greedy, verify_sampling
from outrider.errors import UserError, require


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row (EOS included when it ended the row)
    k: int
    steps: int = 0  # target forwards after prefill
    row_steps: int = 0  # sum over rows of the steps in which the row was active
    proposed: list[int] = field(default_factory=list)  # [k] drafts offered at position i
    accepted: list[int] = field(default_factory=list)  # [k] drafts accepted at position i
    prefill_s: float = 0.0
    decode_s: float = 0.0
    propose_s: float = 0.0  # every draft's span, the prompt's first one included
    verify_s: float = 0.0
    prompt_draft_s: float = 0.0  # of propose_s: the first draft, from the prompt (its head step is prompt-wide)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tau(self) -> float:
        """Mean tokens a verify step emits per row: 1 + accepted drafts (bonus token included).

        A step cut short by EOS or ``max_new_tokens`` counts only the drafts whose tokens reached
        the output (``_account``), so tau never exceeds k+1 nor the tokens the steps emitted; 1.0
        for plain decoding.
        """
        return 1.0 + sum(self.accepted) / self.row_steps if self.row_steps else 0.0

    @property
    def accept_rate_per_pos(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]


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


def check_pair(target: torch.nn.Module, draft: torch.nn.Module, target_tok=None, draft_tok=None) -> None:
    """Refuse a draft model that cannot propose target tokens (other vocabulary or tokenizer)."""
    vt, vd = target.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0]
    require(vt == vd, f"draft vocabulary size {vd} differs from the target's {vt}: "
                      "use a draft with the target's tokenizer")
    if target_tok is not None and draft_tok is not None:
        require(target_tok.get_vocab() == draft_tok.get_vocab(),
                "draft tokenizer differs from the target's (same size, other tokens): "
                "use a draft trained with the target's tokenizer")


class _Marks:
    """Per-phase wall time without a host synchronisation per step (CUDA events on GPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append((name, ev))
        else:
            self.events.append((name, time.perf_counter()))

    def totals(self) -> dict[str, float]:
        """Seconds spent from each mark to the next, summed by the first mark's name."""
        if self.cuda and self.events:
            self.events[-1][1].synchronize()
        out: dict[str, float] = {}
        for (name, a), (_, b) in zip(self.events, self.events[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + dt
        return out


class SpecEngine:
    """Decode a batch of prompts with an optional proposer.

    target: a stock Hugging Face causal LM (eval mode); proposer: None for plain decoding.
    """

    AR_CHUNK = 8  # plain greedy decoding: device steps per host synchronisation

    def __init__(self, target: torch.nn.Module, proposer: Proposer | None = None, k: int = 4,
                 sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = (),
                 read_len: str = "auto", graphs: bool = False, compile: bool | str | CompileOptions | None = False,
                 rounds: int = 8,
                 attention: str = "slots"):
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
        self._next: Draft | None = None  # a draft already launched for the next step (pipelined proposers)
        self._active: tuple[tuple[bool, ...], torch.Tensor] | None = None  # alive flags -> their device copy
        self._rounds: DeviceRounds | None = None  # the device rounds of the current batch
        self._rounds_pool: dict[tuple[int, int], DeviceRounds] = {}  # (batch, k) -> rounds (and their CUDA graph)

    def _target_lm(self, B: int, max_len: int, aux_ids) -> CachedLM:
        if not (self.graphs or self.compile):
            return CachedLM(self.target, B, max_len, aux_layer_ids=aux_ids, read_len=self.read_len)
        key = (B, tuple(aux_ids or ()))
        lm = self._pool.get(key)
        if lm is None or lm.cache.max_len < max_len:
            if lm is not None:
                lm.close()
            lm = CachedLM(self.target, B, -(-max_len // 512) * 512, aux_layer_ids=aux_ids, graphs=self.graphs,
                          compile=self.compile, attention=self.attention)
            self._pool[key] = lm
        lm.reset()
        return lm

    def _decode_slots(self, B: int, max_new: int) -> int:
        """Cache slots a request's decoding may take after its prompt. A step takes k+1 slots (its
        rejected ones stay masked); device rounds reuse them, so that the rounds take at most the
        tokens each row verifies: up to ``max_new`` + k, plus the rest of the chunk in which the
        row stopped (``settle``'s accounting, summed over the rows)."""
        k = self.k
        per_step = (max_new + 1) * (k + 1)
        static = static_cache(cached_lm_read_len(self.read_len, self.device, self.graphs, self.compile), self.device)
        if not (static and self._rounds_apply()):
            return per_step
        per_row = max_new + k + (self.rounds - 1) * (k + 1)
        return (k + 1) + min(B * per_row, per_step)  # the first step, then the rounds

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _clock(self) -> float:
        self._sync()
        return time.perf_counter()

    def _first_token(self, logits: torch.Tensor, rand: RowRandom) -> torch.Tensor:
        # logits: [batch, vocab]
        if self.sampling.greedy:
            return logits.argmax(-1)
        return sample(probs(logits, self.sampling), rand.uniform(1, logits.device)[:, 0])

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> GenerationResult:
        require(len(prompts) > 0, "no prompts given")
        require(all(len(p) > 0 for p in prompts), "empty prompt: give at least one token per prompt")
        require(max_new_tokens >= 1, f"max new tokens must be >= 1, got {max_new_tokens}")
        B, k, dev = len(prompts), self.k, self.device
        vocab = self.target.get_output_embeddings().weight.shape[0]
        bad = [t for p in prompts for t in p if not 0 <= int(t) < vocab]
        require(not bad, f"prompt token id {bad[:1]} outside the target vocabulary of {vocab}")
        plens = torch.tensor([len(p) for p in prompts], device=dev)
        P = int(plens.max())
        limit = getattr(self.target.config, "max_position_embeddings", None)
        if limit and P + max_new_tokens > limit:
            raise UserError(f"prompt ({P}) + max new tokens ({max_new_tokens}) exceed the target's "
                            f"{limit} positions: shorten the prompt or ask for fewer tokens")
        # graphs: prompts padded to a few widths, each one's forward replayed as a graph (padding invalid)
        width = min(-(-P // PROMPT_BUCKET) * PROMPT_BUCKET, limit or P + PROMPT_BUCKET)
        if not (self.graphs and prefill_graphs_apply(self.target, B, width)):
            width = P
        max_len = max(P + self._decode_slots(B, max_new_tokens) + 1, width)
        aux_ids = self.proposer.aux_layer_ids if self.proposer is not None else None
        target = self._target_lm(B, max_len, aux_ids)
        rand = RowRandom(B, self.sampling.seed, stream=0)
        result = GenerationResult(tokens=[[] for _ in range(B)], k=k, proposed=[0] * k, accepted=[0] * k)
        try:
            t0 = self._clock()
            ids = torch.zeros(B, width, dtype=torch.long, device=dev)
            for b, p in enumerate(prompts):
                ids[b, :len(p)] = torch.tensor([int(t) for t in p], device=dev)
            valid = torch.arange(width, device=dev)[None, :] < plens[:, None]  # [batch, width]
            ends, which = torch.unique(plens - 1, return_inverse=True)  # last prompt index per row
            logits = target.forward(ids, query_valid=valid, logits_at=ends)  # [batch, len(ends), vocab]
            target.commit(valid)
            rows = torch.arange(B, device=dev)
            last = self._first_token(logits[rows, which], rand)  # [batch]
            histories = [list(map(int, p)) for p in prompts]
            alive = [True] * B
            for b, t in enumerate(last.tolist()):
                self._emit(b, [t], result, histories, alive, max_new_tokens)
            result.prefill_s = self._clock() - t0
            if self.proposer is not None:
                self.proposer.start(StartContext(
                    histories=histories, prompt_lens=plens, last=last, sampling=self.sampling, k=k,
                    max_len=max_len, target_aux=target.aux, device=dev, graphs=self.graphs, compile=self.compile))
            t_dec = time.perf_counter()
            self._next, self._active = None, None
            marks = _Marks(dev)
            run_ahead = self.proposer is None and self.sampling.greedy
            use_rounds = self._device_rounds(target)
            first = True
            while any(alive):
                if run_ahead:
                    last = self._greedy_chunk(target, last, alive, result, histories, max_new_tokens, marks)
                elif use_rounds and not first:  # the first step drafted from the prompt; then whole rounds
                    last = self._round_chunk(target, last, alive, result, histories, max_new_tokens, marks)
                else:
                    last = self._step(target, last, alive, rand, result, histories, max_new_tokens, marks)
                first = False
            marks.mark("end")
            result.decode_s = self._clock() - t_dec
            spans = marks.totals()
            result.prompt_draft_s = spans.get("prompt_draft", 0.0)
            result.propose_s = spans.get("propose", 0.0) + result.prompt_draft_s
            result.verify_s = spans.get("verify", 0.0)
        finally:
            if not (self.graphs or self.compile):
                target.close()
            if self.proposer is not None:
                self.proposer.close()
        return result

    def _step(self, target: CachedLM, last: torch.Tensor, alive: list[bool], rand: RowRandom,
              result: GenerationResult, histories: list[list[int]], max_new: int, marks: "_Marks") -> torch.Tensor:
        B, dev = last.shape[0], last.device
        active = self._active_rows(alive, dev)
        if self.proposer is not None:
            if self._next is None:
                marks.mark("prompt_draft" if result.steps == 0 else "propose")
                draft = self.proposer.propose(self.k)
            else:  # launched at the end of the previous step
                draft, self._next = self._next, None
            draft.num = torch.where(active, draft.num, torch.zeros_like(draft.num))
        else:
            marks.mark("propose")
            draft = Draft.chain(torch.zeros(B, 0, dtype=torch.long, device=dev), torch.zeros(B, dtype=torch.long, device=dev))
        marks.mark("verify")
        inputs = torch.cat([last[:, None], draft.tokens], dim=1)  # [batch, k+1]
        logits = target.forward(inputs)  # [batch, k+1, vocab]
        kk = draft.tokens.shape[1]
        if self.sampling.greedy:
            res = verify_greedy(draft.tokens, draft.num, logits)
        else:
            u = rand.uniform(kk + 1, dev)
            res = verify_sampling(draft.tokens, draft.num, draft.q, probs(logits, self.sampling), u[:, :kk], u[:, kk])
        n_acc = torch.where(active, res.num_accepted, torch.zeros_like(res.num_accepted))
        # the one host synchronisation of the step: accepted counts, output tokens, draft sizes
        packed = torch.cat([n_acc[:, None], draft.num[:, None], res.tokens], dim=1)  # [batch, 2 + k+1]
        keep = (torch.arange(kk + 1, device=dev)[None, :] <= n_acc[:, None]) & active[:, None]
        ahead = self._ahead(target)
        if ahead:  # the next draft is launched before the host waits for this step's outcome
            on_host = packed.to("cpu", non_blocking=True)  # on CUDA a copy queued behind the step
            ready = torch.cuda.Event() if dev.type == "cuda" else None
            if ready is not None:
                ready.record()
            target.commit(keep, used=kk + 1)  # slots past the accepted ones stay masked: no host value needed
            marks.mark("observe")
            self.proposer.observe(Outcome(draft, n_acc, res.tokens, active, target.aux))
            marks.mark("propose")
            self._next = self.proposer.propose(self.k)
            if ready is not None:
                ready.synchronize()
            host = on_host.tolist()
        else:
            host = packed.tolist()
            n_list = [row[0] for row in host]
            target.commit(keep, used=max((n + 1 for n, a in zip(n_list, alive) if a), default=0))
        for b in range(B):
            if not alive[b]:
                continue
            self._account(b, host[b], kk, result, histories, alive, max_new)
        result.steps += 1
        if self.proposer is not None and not ahead:
            marks.mark("observe")
            self.proposer.observe(Outcome(draft, n_acc, res.tokens, self._active_rows(alive, dev), target.aux))
        return res.tokens[torch.arange(B, device=dev), n_acc]

    def _active_rows(self, alive: list[bool], dev: torch.device) -> torch.Tensor:
        """``alive`` as a device tensor [batch] bool, copied again only when a row has stopped
        (a host-to-device copy waits for the queued work, a pipelined draft included)."""
        key = tuple(alive)
        if self._active is None or self._active[0] != key:
            self._active = (key, torch.tensor(alive, device=dev))
        return self._active[1]

    def _ahead(self, target: CachedLM) -> bool:
        """Pipeline the next draft behind this step's verification? Only for a proposer that needs
        nothing from the host (``device_side``), over a static cache (whose spare slots absorb a
        commit that does not know how many drafts were accepted; graphs or compile)."""
        return self.proposer is not None and getattr(self.proposer, "device_side", False) and target.cache.static

    def _device_rounds(self, target: CachedLM) -> bool:
        """Run greedy speculation as device rounds (``outrider.spec_rounds``)? For a proposer that
        drafts with device operations alone, over a static cache, after a pipelined first step."""
        return self._rounds_apply() and target.cache.static

    def _rounds_apply(self) -> bool:
        """Device rounds, given a static cache: greedy, and a proposer that drafts on the device alone."""
        return (self.rounds > 0 and self.sampling.greedy and getattr(self.proposer, "device_rounds", False)
                and getattr(self.proposer, "device_side", False))

    def _round_chunk(self, target: CachedLM, last: torch.Tensor, alive: list[bool], result: GenerationResult,
                     histories: list[list[int]], max_new: int, marks: "_Marks") -> torch.Tensor:
        """Up to ``self.rounds`` speculative rounds per host synchronisation, all on the device.

        The chunk never runs past what the longest remaining request can still need (a round
        emits at most k+1 tokens); a row that stops inside it ignores its later rounds. The
        tokens are the ones ``_step`` would emit; verification and draft are timed apart.
        """
        B, k, dev = last.shape[0], self.k, last.device
        left = max(max_new - len(result.tokens[b]) for b in range(B) if alive[b])
        n = max(1, min(self.rounds, -(-left // (k + 1))))
        active = self._active_rows(alive, dev)
        if self._next is not None:  # the draft the pipelined first step launched
            rounds = self._rounds_pool.get((B, k))
            if rounds is None or not rounds.key_matches(target, self.proposer, B, k, self.rounds):
                rounds = DeviceRounds(target, self.proposer, B, k, self.rounds, self.graphs)
                if self.graphs:  # kept with its graph; elsewhere caches are not reused either
                    self._rounds_pool[(B, k)] = rounds
            self._rounds = rounds
            self._rounds.load(last, self._next.tokens, active)
            self._next = None
        else:
            self._rounds.active.copy_(active)
        host = self._rounds.run(n, marks.mark).tolist()  # [batch][round][n_acc, num, k+1 tokens]
        self._rounds.settle(host)
        marks.mark("observe")
        for r in range(n):
            if not any(alive):
                break
            for b in range(B):
                if not alive[b]:
                    continue
                self._account(b, host[b][r], k, result, histories, alive, max_new)
            result.steps += 1
        return self._rounds.last

    def _greedy_chunk(self, target: CachedLM, last: torch.Tensor, alive: list[bool], result: GenerationResult,
                      histories: list[list[int]], max_new: int, marks: "_Marks") -> torch.Tensor:
        """Plain greedy decoding, up to ``AR_CHUNK`` steps per host synchronisation.

        Nothing needs the host between two greedy steps, so the steps run back to back on the
        device (``CachedLM.greedy_run``) and EOS is checked once per chunk; the chunk never runs
        past the longest remaining request. The tokens are the ones ``_step`` would emit.
        """
        left = max(max_new - len(result.tokens[b]) for b in range(len(alive)) if alive[b])
        n = min(self.AR_CHUNK, left)
        marks.mark("verify")
        toks = target.greedy_run(last, n)  # [batch, n]
        host = toks.tolist()
        for b in range(len(alive)):
            i = 0
            while alive[b] and i < n:
                result.row_steps += 1
                self._emit(b, host[b][i:i + 1], result, histories, alive, max_new)
                i += 1
        result.steps += n
        marks.mark("observe")
        return toks[:, -1]

    def _account(self, b: int, record: list[int], k: int, result: GenerationResult, histories: list[list[int]],
                 alive: list[bool], max_new: int) -> None:
        """One step of row b from its record [accepted, drafted, k+1 verified tokens]: emit, then count.

        A step that EOS or ``max_new_tokens`` cut after e < n+1 of its tokens counts its first e-1
        draft positions only (all accepted): its count is then the e tokens it emitted, not the n+1
        the verifier allowed, and the positions past the cut are neither proposed nor accepted."""
        n, num, toks = record[0], record[1], record[2:]
        result.row_steps += 1
        before = len(result.tokens[b])
        self._emit(b, toks[:n + 1], result, histories, alive, max_new)
        emitted = len(result.tokens[b]) - before
        for i in range(k if emitted == n + 1 else emitted - 1):
            result.proposed[i] += int(num > i)
            result.accepted[i] += int(n > i)

    def _emit(self, b: int, toks: list[int], result: GenerationResult, histories: list[list[int]],
              alive: list[bool], max_new: int) -> None:
        out = result.tokens[b]
        for t in toks:
            out.append(t)
            histories[b].append(t)
            if t in self.eos or len(out) >= max_new:
                alive[b] = False
                return
