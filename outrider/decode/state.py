"""Per-request decoding state: what one ``generate`` call knows about each of its rows.

Contract: ``RequestState`` holds, per row, the history (prompt + emitted tokens), the prompt
length, whether the row is still generating, its random stream and the token it feeds next
(``last``, on the device), and per call the records (``GenerationResult``) and the phase timer.
``record`` takes a step's outcome as read on the host, ``[accepted, drafted, k+1 verified
tokens]`` per row, emits what the row may emit (up to EOS or ``max_new_tokens``) and counts it.
Every strategy (``decode.strategies``) emits through it, so all count alike.

Not done here: rows joining or leaving between calls (continuous batching builds on this).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from outrider.decode.sampling import RowRandom


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row (EOS included when it ended the row)
    k: int
    steps: int = 0  # target forwards after prefill
    row_steps: int = 0  # sum over rows of the steps in which the row was active
    proposed: list[int] = field(default_factory=list)  # [k] drafts offered at position i
    accepted: list[int] = field(default_factory=list)  # [k] drafts accepted at position i
    uncut_accepted: int = 0  # drafts the verifier accepted, steps cut by EOS/max_new_tokens included (engines' count)
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
        the output (``RequestState.record``), so tau never exceeds k+1 nor the tokens the steps
        emitted; 1.0 for plain decoding.
        """
        return 1.0 + sum(self.accepted) / self.row_steps if self.row_steps else 0.0

    @property
    def uncut_tau(self) -> float:
        """tau as serving engines count it (vLLM's ``spec_decode_*`` counters): a step cut by EOS
        or ``max_new_tokens`` counts every draft the verifier accepted, emitted or not."""
        return 1.0 + self.uncut_accepted / self.row_steps if self.row_steps else 0.0

    @property
    def accept_rate_per_pos(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @classmethod
    def pooled(cls, results: list["GenerationResult"]) -> "GenerationResult":
        """Several ``generate`` calls at the same k as one: rows, counts and seconds summed (its tau and
        acceptance are over all their steps)."""
        k = results[0].k
        return cls([t for r in results for t in r.tokens], k, sum(r.steps for r in results),
                   sum(r.row_steps for r in results), [sum(r.proposed[i] for r in results) for i in range(k)],
                   [sum(r.accepted[i] for r in results) for i in range(k)], sum(r.uncut_accepted for r in results),
                   *(sum(getattr(r, name) for r in results)
                     for name in ("prefill_s", "decode_s", "propose_s", "verify_s", "prompt_draft_s")))


class Marks:
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


class RequestState:
    """The rows of one ``generate`` call: histories, prompt lengths, alive flags, random streams."""

    def __init__(self, prompts: Sequence[Sequence[int]], k: int, max_new: int, eos: set[int], seed: int,
                 device: torch.device):
        B = len(prompts)
        self.k, self.max_new, self.eos, self.device = k, max_new, eos, device
        self.histories = [list(map(int, p)) for p in prompts]  # per row: prompt + emitted tokens
        self.prompt_lens = torch.tensor([len(p) for p in prompts], device=device)  # [batch]
        self.alive = [True] * B  # rows still generating
        self.rand = RowRandom(B, seed, stream=0)  # the verifier's uniforms, a stream per row
        self.last = torch.zeros(B, dtype=torch.long, device=device)  # [batch] the token each row feeds next
        self.result = GenerationResult(tokens=[[] for _ in range(B)], k=k, proposed=[0] * k, accepted=[0] * k)
        self.marks = Marks(device)
        self._active: tuple[tuple[bool, ...], torch.Tensor] | None = None  # alive flags -> their device copy

    @property
    def batch(self) -> int:
        return len(self.alive)

    def any_alive(self) -> bool:
        return any(self.alive)

    def tokens_left(self) -> int:
        """The most tokens a row still generating may yet emit."""
        return max(self.max_new - len(self.result.tokens[b]) for b in range(self.batch) if self.alive[b])

    def active_rows(self) -> torch.Tensor:
        """``alive`` as a device tensor [batch] bool, copied again only when a row has stopped
        (a host-to-device copy waits for the queued work, a pipelined draft included)."""
        key = tuple(self.alive)
        if self._active is None or self._active[0] != key:
            self._active = (key, torch.tensor(self.alive, device=self.device))
        return self._active[1]

    def record(self, host: list[list[int]], k: int) -> None:
        """One step of every row alive, from its record [accepted, drafted, k+1 verified tokens]."""
        for b in range(self.batch):
            if self.alive[b]:
                self.account(b, host[b], k)
        self.result.steps += 1

    def account(self, b: int, record: list[int], k: int) -> None:
        """One step of row b from its record [accepted, drafted, k+1 verified tokens]: emit, then count.

        A step that EOS or ``max_new_tokens`` cut after e < n+1 of its tokens counts its first e-1
        draft positions only (all accepted): its count is then the e tokens it emitted, not the n+1
        the verifier allowed, and the positions past the cut are neither proposed nor accepted."""
        n, num, toks = record[0], record[1], record[2:]
        result = self.result
        result.row_steps += 1
        result.uncut_accepted += n
        before = len(result.tokens[b])
        self.emit(b, toks[:n + 1])
        emitted = len(result.tokens[b]) - before
        for i in range(k if emitted == n + 1 else emitted - 1):
            result.proposed[i] += int(num > i)
            result.accepted[i] += int(n > i)

    def emit(self, b: int, toks: list[int]) -> None:
        """Append row b's tokens up to (and with) the first EOS or the ``max_new_tokens``-th."""
        out = self.result.tokens[b]
        for t in toks:
            out.append(t)
            self.histories[b].append(t)
            if t in self.eos or len(out) >= self.max_new:
                self.alive[b] = False
                return
