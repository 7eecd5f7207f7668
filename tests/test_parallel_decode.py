"""Parallel drafting (P-EAGLE) in SpecEngine: lossless, one head forward per round, the drafts are
exactly what TTT trains (placeholders at steps after the first), sampling reproducible."""

from __future__ import annotations

import pytest
import torch
from tiny import assert_compiled_greedy_is_plain, assert_rounds_are_the_ttt_unroll, random_head

from outrider.decode.engine import SpecEngine
from outrider.decode.proposers import PROPOSERS
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.decode.proposers.parallel import ParallelProposer
from outrider.decode.sampling import SamplingParams

MAX_NEW = 16
CASES = [("llama", "gqa"), ("deepseek_v3", "mla")]


def _head(model, attention="gqa", seed=0, parallel=True, dv=64):
    options = {"parallel_drafting": True, "mask_token_id": 3} if parallel else {}
    return random_head(model, dv, seed, attention=attention, **options)


def _prompts(n=(5, 11, 3, 8)):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(5, 90, (m,), generator=g).tolist() for m in n]


@pytest.mark.parametrize("kind, attention", CASES)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_greedy(tiny_models, kind, attention, batch):
    model = tiny_models(kind)
    prompts = _prompts()
    refs = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)[0, len(p):]
            .tolist() for p in prompts]
    engine = SpecEngine(model, ParallelProposer(_head(model, attention), model), k=4)
    got = []
    for i in range(0, len(prompts), batch):
        got.extend(engine.generate(prompts[i:i + batch], MAX_NEW).tokens)
    assert got == refs


def test_device_rounds_equal_plain_greedy(tiny_models):
    """The static slot cache runs greedy chains as device rounds (``propose_device``), on the CPU too."""
    model = tiny_models("llama")
    prompts = _prompts()
    refs = SpecEngine(model, None).generate(prompts, MAX_NEW).tokens
    engine = SpecEngine(model, ParallelProposer(_head(model), model), k=3, read_len="max")
    assert engine.generate(prompts, MAX_NEW).tokens == refs


@pytest.mark.parametrize("kind, attention", CASES)
def test_compiled_drafting_equals_plain_greedy_and_compiles_once_per_batch(tiny_models, kind, attention):
    """With the engine's step compiled, the greedy forward and its draws run through torch.compile
    (aot_eager: the traced and functionalised graph, eager kernels): batch 1 and 2, per-step and
    device rounds, tokens equal plain greedy; the forward compiles once per batch size, the prompt's
    block runs eagerly (no variant per prompt width)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = tiny_models(kind)
    prompts = _prompts()
    proposer = ParallelProposer(_head(model, attention), model)
    assert_compiled_greedy_is_plain(model, proposer, prompts, MAX_NEW)
    assert len(_debug_get_cache_entry_list(ParallelProposer._block_greedy.__code__)) == 2  # batch 1 and batch 2


@pytest.mark.parametrize("kind, attention", CASES)
def test_the_drafts_are_the_training_unroll_and_one_forward(tiny_models, kind, attention):
    """Every draft of every round is what TTT (placeholders at steps > 0) predicts at the round's
    position, and each round costs one head forward."""
    model = tiny_models(kind)
    head, k = _head(model, attention, seed=2), 4
    proposer = ParallelProposer(head, model)
    rounds, propose, calls = [], proposer.propose, []
    layer_forward = head.after_attention

    def counting(*a):
        calls.append(1)
        return layer_forward(*a)

    def recording(n):
        before = len(calls)
        draft = propose(n)
        assert len(calls) - before == 1
        rounds.append((list(proposer.ctx.histories[0]), draft.tokens[0].tolist()))
        return draft

    head.after_attention = counting
    proposer.propose = recording
    SpecEngine(model, proposer, k=k).generate(_prompts()[1:2], 14)
    assert_rounds_are_the_ttt_unroll(model, head, rounds, k)


def test_first_draft_is_eagle3s():
    """Position 0 of the parallel forward is EAGLE-3's pending step: the same first token."""
    from tiny import make_tiny

    model = make_tiny("llama", 0)
    head = _head(model, seed=5)
    seen = {}
    for cls in (Eagle3Proposer, ParallelProposer):
        proposer = cls(head, model)
        firsts, propose = [], proposer.propose

        def recording(n, propose=propose, firsts=firsts):
            draft = propose(n)
            firsts.append(draft.tokens[:, 0].tolist())
            return draft

        proposer.propose = recording
        SpecEngine(model, proposer, k=1).generate(_prompts()[:2], 10)
        seen[cls.name] = firsts
    assert seen["eagle3"] == seen["parallel"]


def test_sampling_is_reproducible_under_a_seed(tiny_models):
    model = tiny_models("llama")
    def run(seed):
        engine = SpecEngine(model, ParallelProposer(_head(model), model), k=3,
                            sampling=SamplingParams(temperature=0.8, seed=seed))
        return engine.generate(_prompts(), MAX_NEW).tokens

    first = run(11)
    assert run(11) == first
    assert run(12) != first


def test_registry_and_refusals(tiny_models):
    model = tiny_models("llama")
    assert PROPOSERS["parallel"].needs == "parallel-head"
    assert isinstance(PROPOSERS["parallel"].build(model, _head(model)), ParallelProposer)
    with pytest.raises(ValueError, match="parallel-drafting head"):
        ParallelProposer(_head(model, parallel=False), model)
