"""EAGLE-3 drafting in SpecEngine: lossless with any head, and incremental drafting equals a
full recomputation of the head over the committed sequence."""

from __future__ import annotations

import pytest
import torch
from tiny import random_head

from outrider.decode.engine import SpecEngine
from outrider.decode.proposers.eagle3 import Eagle3Proposer, _pad_left
from outrider.decode.proposers.head_cache import SLOT_ALIGN, HeadCache
from outrider.decode.sampling import SamplingParams
from outrider.models import AuxCapture
from outrider.train.loop.ttt import ttt_loss

MAX_NEW = 20


def _head(model, draft_vocab=64, seed=0):
    return random_head(model, draft_vocab, seed)


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(5, 90, (n,), generator=g).tolist() for n in (5, 11, 3)]


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_transformers(tiny_kind, tiny_models, batch):
    model = tiny_models(tiny_kind)
    prompts = _prompts()
    refs = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]
    engine = SpecEngine(model, Eagle3Proposer(_head(model), model), k=3)
    got = []
    for i in range(0, len(prompts), batch):
        got.extend(engine.generate(prompts[i:i + batch], MAX_NEW).tokens)
    assert got == refs


def test_first_draft_equals_full_recomputation(tiny_kind, tiny_models):
    """The cached chain (Llama: grouped query heads folded into query rows) against the head
    run over the whole committed sequence without a cache, as in training."""
    model = tiny_models(tiny_kind)
    head = _head(model)
    proposer = Eagle3Proposer(head, model)
    rounds = _rounds(proposer)
    SpecEngine(model, proposer, k=3).generate(_prompts()[:1], MAX_NEW)
    assert len(rounds) > 3
    for history, (first, *_) in rounds:
        seq = torch.tensor([history])
        with AuxCapture(model, head.config.aux_layer_ids) as cap:
            model(seq)
            aux = cap.concat()  # [1, L, 3H]
        # pairs (aux_t, x_{t+1}) for t = 0..L-2; the last one predicts the first draft token
        logits, _ = head(model.get_input_embeddings()(seq[:, 1:]), head.fuse(aux[:, :-1]),
                         torch.arange(seq.shape[1] - 1)[None])
        assert int(head.map_to_target(logits[0, -1].argmax())) == first


def _rounds(proposer: Eagle3Proposer) -> list:
    """Every round ``proposer.propose`` drafts from now on, of the batch's first row: (its history
    when the round was drafted, the drafted tokens)."""
    seen, propose = [], proposer.propose

    def recording(k):
        draft = propose(k)
        seen.append((list(proposer.ctx.histories[0]), draft.tokens[0].tolist()))
        return draft

    proposer.propose = recording
    return seen


def _drafts(proposer: Eagle3Proposer) -> list:
    """Every draft ``proposer.propose`` returns from now on, as lists of tokens."""
    seen, propose = [], proposer.propose

    def recording(k):
        draft = propose(k)
        seen.append(draft.tokens.tolist())
        return draft

    proposer.propose = recording
    return seen


def test_a_prompt_block_padded_on_the_left_drafts_the_same(tiny_kind, tiny_models):
    """With graphs a prompt's pending block is padded on the left to a multiple of 64 positions
    (``_pad_left``): the padding is invalid, changes no draft of the request (ragged rows of
    a batch and one row), and leaves nothing in the head cache that a later draft would read."""
    model = tiny_models(tiny_kind)
    drafts = {}
    for pad in (False, True):
        proposer = Eagle3Proposer(_head(model), model)
        if pad:
            start = proposer.start

            def padded_start(ctx, start=start, proposer=proposer):
                start(ctx)
                proposer.pending = _pad_left(proposer.pending, 64)

            proposer.start = padded_start
        drafts[pad] = _drafts(proposer)
        engine = SpecEngine(model, proposer, k=3)
        engine.generate(_prompts(), MAX_NEW)
        engine.generate(_prompts()[1:2], MAX_NEW)
    assert len(drafts[False]) > 5 and drafts[True] == drafts[False]


def test_sampling_deterministic(tiny_models):
    model = tiny_models("llama")
    s = SamplingParams(temperature=1.0, seed=5)
    a = SpecEngine(model, Eagle3Proposer(_head(model), model), k=3, sampling=s).generate(_prompts(), 16).tokens
    b = SpecEngine(model, Eagle3Proposer(_head(model), model), k=3, sampling=s).generate(_prompts(), 16).tokens
    assert a == b


def test_compiled_draft_steps_draft_what_eager_steps_draft(tiny_kind, tiny_models):
    """The fused draft step (positions, cache slots, mask and layer traced by torch.compile; the
    aot_eager backend keeps the eager kernels) proposes exactly the eager chain's tokens."""
    model = tiny_models(tiny_kind)
    drafts = {}
    for compile in (False, "aot_eager"):
        proposer = Eagle3Proposer(_head(model), model)
        drafts[compile] = _drafts(proposer)
        engine = SpecEngine(model, proposer, k=3, compile=compile, read_len="max", rounds=0)
        assert engine.generate(_prompts()[:2], MAX_NEW).tokens
    assert len(drafts[False]) > 5 and drafts["aot_eager"] == drafts[False]


def test_compiled_draft_step_compiles_once_per_role(tiny_models):
    """Pending steps of any k compile the fused draft step twice at most (the width turns dynamic;
    a prompt's block runs eager), the chain's link once (no int, stride or lazily allocated buffer
    to guard on), and a second engine's cache of the same target adds no target step
    compilation (its hidden-state hooks are on only while its own steps run)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from outrider.decode import runner

    def compiled_variants(fn) -> int:
        return len(_debug_get_cache_entry_list(fn.__code__))

    model = tiny_models("llama")
    torch._dynamo.reset()
    proposer = Eagle3Proposer(_head(model), model)
    for k in (2, 3):
        engine = SpecEngine(model, proposer, k=k, compile="aot_eager")
        for p in _prompts()[:2]:
            assert engine.generate([p], 12).tokens
    assert compiled_variants(Eagle3Proposer._step_body) <= 2  # k+1 wide: one k, then any (prompts run eager)
    assert compiled_variants(Eagle3Proposer._link_greedy) == 1
    targets = compiled_variants(runner._plain_step)
    SpecEngine(model, Eagle3Proposer(_head(model), model), k=3, compile="aot_eager").generate(_prompts()[:1], 12)
    assert compiled_variants(runner._plain_step) == targets


def test_head_cache_slots_are_aligned_and_the_extra_ones_never_seen():
    cache = HeadCache(2, 100, 3, 8, torch.float32, torch.device("cpu"))
    assert cache.keys.shape == (2, 3, 128, 8) and cache.keys.shape[2] % SLOT_ALIGN == 0
    positions = torch.tensor([[5, 99], [0, 7]])  # [batch, n]
    valid = torch.tensor([[True, True], [False, True]])
    mask = cache.mask(positions, valid)[:, 0]  # [batch, n, slots]
    assert torch.equal(mask[0, 1, :100], torch.ones(100, dtype=torch.bool)) and mask[0, 0, :6].all()
    assert not mask[0, 0, 6:].any() and not mask[:, :, 101:].any()  # past the scratch slot: never
    assert mask[1, 0].nonzero().flatten().tolist() == [100]  # padding sees the scratch slot only


def test_whole_chain_is_the_training_unroll(tiny_kind, tiny_models):
    """Every draft of every round, not only the first, is what the TTT unroll predicts at the round's
    position when the drafts are the sequence's next tokens: the engine drafts the chain training
    teaches (the held-out tau the engine measures is then the training's walked tau on that text)."""
    model = tiny_models(tiny_kind)
    head, k = _head(model), 3
    proposer = Eagle3Proposer(head, model)
    rounds = _rounds(proposer)
    SpecEngine(model, proposer, k=k).generate(_prompts()[:1], MAX_NEW)
    assert len(rounds) > 3
    dv = head.config.draft_vocab_size
    draft_of = {int(t): d for d, t in enumerate((torch.arange(dv) + head.d2t).tolist())}  # target id -> draft id
    for history, drafts in rounds:
        seq = torch.tensor([history + drafts])  # [1, L + k]: the drafts as the next tokens
        L = len(history)
        with AuxCapture(model, head.config.aux_layer_ids) as cap:
            model(seq)
            aux = cap.concat()  # [1, L + k, 3H]
        # teacher row L-1+j names draft j+1 (the prediction of x_{L+j}); the rows before never decide
        teacher = torch.zeros(1, L + k, dv)
        for j, token in enumerate(drafts):
            teacher[0, L - 1 + j, draft_of[token]] = 1.0
        with torch.no_grad():
            out = ttt_loss(head, model.get_input_embeddings(), aux, seq, torch.ones_like(seq), teacher,
                           steps=k, agree_map=True)
        assert out.agree[:, 0, L - 2].tolist() == [True] * k, (L, drafts)
