"""Device rounds (``decode.strategies.rounds``): whole greedy speculative rounds on the device, several
per host synchronisation, emit exactly what the one-step-per-synchronisation loop emits.

On the CPU the static cache (``read_len="max"``) takes the same slot arithmetic as on a GPU, and
the rounds run eagerly. ``Scripted`` is a device-side proposer that knows the target's greedy
continuation and spoils some of its drafts on purpose, so that every acceptance length from 0 to
k occurs; the engine, the cache and the target are the real ones.
"""

from __future__ import annotations

import pytest
import torch
from test_eagle3_proposer import _head
from test_engine import _hf_greedy, _prompts

from outrider.decode.engine import SpecEngine
from outrider.decode.draft import Draft
from outrider.decode.proposers.base import Outcome, Proposer, StartContext
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.decode.strategies.rounds import DeviceRounds, accept_round

MAX_NEW = 30


class Scripted(Proposer):
    """Drafts the next k tokens of each row's reference continuation, with draft position
    ``(round + row) mod (k+1)`` of a row spoiled (none when it is k): every acceptance length from 0
    to k occurs, and rows of a round accept different numbers (device operations only)."""

    name = "scripted"
    device_side = True
    device_rounds = True

    def __init__(self, refs: list[list[int]], vocab: int):
        self.refs, self.vocab = refs, vocab

    def start(self, ctx: StartContext) -> None:
        super().start(ctx)
        width = max(len(r) for r in self.refs) + ctx.max_len
        self.ref = torch.zeros(len(self.refs), width, dtype=torch.long, device=ctx.device)  # [batch, width]
        for b, r in enumerate(self.refs):
            self.ref[b, :len(r)] = torch.tensor(r)
        self.pos = torch.ones(len(self.refs), dtype=torch.long, device=ctx.device)  # [batch] next ref index
        self.rounds = torch.zeros(len(self.refs), dtype=torch.long, device=ctx.device)  # [batch]

    def propose_device(self, k: int) -> torch.Tensor:
        idx = (self.pos[:, None] + torch.arange(k, device=self.pos.device)).clamp_max(self.ref.shape[1] - 1)
        good = self.ref.gather(1, idx)  # [batch, k]
        row = torch.arange(idx.shape[0], device=idx.device)
        spoil = torch.arange(k, device=idx.device)[None, :] == ((self.rounds + row)[:, None] % (k + 1))
        return torch.where(spoil, (good + 1) % self.vocab, good)

    def propose(self, k: int) -> Draft:
        tokens = self.propose_device(k)
        return Draft.chain(tokens, torch.full((tokens.shape[0],), k, device=tokens.device))

    def observe(self, outcome: Outcome) -> None:
        self.pos += torch.where(outcome.active, outcome.num_accepted + 1, 0)
        self.rounds += 1

    def device_state(self) -> list[torch.Tensor]:
        return [self.pos, self.rounds]


def _run(model, prompts, refs, k, read_len, eos=(), rounds=8):
    engine = SpecEngine(model, Scripted(refs, model.config.vocab_size), k=k, read_len=read_len, eos_ids=eos,
                        rounds=rounds)
    return engine, engine.generate(prompts, MAX_NEW)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_rounds_emit_what_the_step_loop_emits(tiny_models, k):
    model = tiny_models("llama")
    prompts = _prompts()
    refs = [_hf_greedy(model, p, MAX_NEW) for p in prompts]
    engine, rounds = _run(model, prompts, refs, k, "max")
    assert isinstance(engine.rounds_runner, DeviceRounds)  # the rounds ran
    _, steps = _run(model, prompts, refs, k, "used")
    stepped, pipelined = _run(model, prompts, refs, k, "max", rounds=0)  # the static cache, one step per sync
    assert stepped.rounds_runner is None
    assert rounds.tokens == refs == steps.tokens == pipelined.tokens
    assert pipelined.accepted == steps.accepted
    assert (rounds.steps, rounds.row_steps) == (steps.steps, steps.row_steps)
    assert rounds.proposed == steps.proposed and rounds.accepted == steps.accepted
    assert rounds.tau > 1.3  # accepted drafts do occur ...
    assert 0 < rounds.accepted[-1] < rounds.proposed[-1]  # ... and so do rejections


def test_rows_stopping_inside_a_chunk(tiny_models):
    """One row meets EOS, the others run to the length limit; each stops where plain decoding does."""
    model = tiny_models("llama")
    prompts = _prompts()
    full = [_hf_greedy(model, p, MAX_NEW) for p in prompts]
    eos = full[1][7]  # a token that ends row 1 early (and may end the others where it occurs)
    want = []
    for r in full:
        cut = r.index(eos) + 1 if eos in r else len(r)
        want.append(r[:cut])
    engine, got = _run(model, prompts, full, 3, "max", eos=(eos,))
    assert got.tokens == want
    _, steps = _run(model, prompts, full, 3, "used", eos=(eos,))
    assert got.accepted == steps.accepted and got.row_steps == steps.row_steps


def test_eagle3_rounds_equal_transformers(tiny_kind, tiny_models):
    """A real EAGLE-3 head through the rounds, twice with one engine (on the CPU each call builds its
    cache and rounds anew; graph mode's reuse is checked in ``test_gpu.py``)."""
    model = tiny_models(tiny_kind)
    prompts = _prompts()
    refs = [_hf_greedy(model, p, MAX_NEW) for p in prompts]
    engine = SpecEngine(model, Eagle3Proposer(_head(model), model), k=4, read_len="max")
    for _ in range(2):
        assert engine.generate(prompts, MAX_NEW).tokens == refs
        assert isinstance(engine.rounds_runner, DeviceRounds)


def test_compiled_acceptance_emits_what_the_step_loop_emits(tiny_models):
    """With the target's step compiled (inductor), the round's acceptance and commit are compiled
    too; tokens, acceptances and steps stay those of the eager one-step-per-sync loop."""
    model = tiny_models("llama")
    prompts = _prompts()
    refs = [_hf_greedy(model, p, MAX_NEW) for p in prompts]
    engine = SpecEngine(model, Scripted(refs, model.config.vocab_size), k=3, read_len="max", compile="inductor")
    fused = engine.generate(prompts, MAX_NEW)
    assert isinstance(engine.rounds_runner, DeviceRounds) and engine.rounds_runner._accept is not accept_round
    _, steps = _run(model, prompts, refs, 3, "used")
    assert fused.tokens == refs == steps.tokens
    assert fused.accepted == steps.accepted and fused.row_steps == steps.row_steps


@pytest.mark.parametrize("batch", [1, 3])
def test_rounds_reuse_the_slots_no_row_kept(tiny_models, batch):
    """Each round's verification starts right after the last slot any row kept, overwriting the
    rejected ones: at batch 1 the rounds take as many slots as they verify tokens (a round of k+1
    slots each before), the cache is sized for that, and the host's first free slot (``settle``)
    is the device's; rows accepting different numbers per round still decode exactly."""
    model = tiny_models("llama")
    prompts = _prompts()[:batch]
    refs = [_hf_greedy(model, p, MAX_NEW) for p in prompts]
    k = 3
    engine, got = _run(model, prompts, refs, k, "max")
    assert got.tokens == refs
    cache = engine.rounds_runner.target.cache
    assert cache.ptr == int(cache.ptr_dev)
    rounds = got.steps - 1  # after the first step, from the prompt
    P = max(len(p) for p in prompts)
    taken = cache.ptr - P - (k + 1)  # the rounds' slots
    if batch == 1:
        assert taken <= len(got.tokens[0]) + k < rounds * (k + 1)
        assert cache.max_len < P + (MAX_NEW + 1) * (k + 1)
    else:
        assert taken < rounds * (k + 1)
