"""``slot_attention`` computes the model's own attention: on Llama (grouped query heads) and on
DeepSeek-V3 (MLA: other head sizes for keys and values), through the slot cache with rejected
slots masked, with additive and boolean masks; the engine's greedy tokens are unchanged with it;
the model gets its own attention back after the block."""

from __future__ import annotations

import pytest
import torch
from test_engine import _hf_greedy, _prompts
from torch.nn import functional as F

from outrider.decode.engine import SpecEngine
from outrider.decode.runner import CachedLM
from outrider.ops.slot_attention import NAME, slot_attention, using_slot_attention


def _step_logits(model, slots: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 90, (2, 12), generator=g)
    lm = CachedLM(model, 2, 64, read_len="max")
    lm.forward(ids, query_valid=torch.ones_like(ids, dtype=torch.bool))
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[0, 7:] = False  # row 0 rejected its last five tokens: masked slots between committed ones
    lm.commit(keep)
    lm.forward(ids[:, :3])
    lm.commit(torch.tensor([[True, False, True], [True, True, True]]))
    with using_slot_attention(model, slots):
        return lm.forward(ids[:, 4:9])  # [2, 5, vocab]


def test_equals_the_models_attention_through_the_slot_cache(tiny_kind, tiny_models):
    model = tiny_models(tiny_kind)
    ref, got = _step_logits(model, False), _step_logits(model, True)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("g", [1, 3])
def test_boolean_and_additive_masks_equal_sdpa(g):
    gen = torch.Generator().manual_seed(0)
    B, H_kv, n, S, d = 2, 2, 4, 11, 8
    q = torch.randn(B, H_kv * g, n, d, generator=gen)
    k, v = torch.randn(B, H_kv, S, d, generator=gen), torch.randn(B, H_kv, S, 5, generator=gen)
    allowed = torch.rand(B, 1, n, S, generator=gen) < 0.6
    allowed[..., 0] = True  # every query sees a slot
    additive = torch.zeros(B, 1, n, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                         attn_mask=allowed).transpose(1, 2)  # [B, n, H, 5]
    for mask in (allowed, additive):
        out, weights = slot_attention(None, q, k, v, mask)
        assert weights is None and out.shape == (B, n, H_kv * g, 5)
        assert torch.allclose(out, ref, atol=1e-6), (out - ref).abs().max()
    # no mask: causal, the queries being the last keys (the n queries over the last n of S keys)
    causal = torch.ones(n, S, dtype=torch.bool).tril(S - n)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                         attn_mask=causal).transpose(1, 2)
    assert torch.allclose(slot_attention(None, q, k, v, None)[0], ref, atol=1e-6)
    square = F.scaled_dot_product_attention(q, k[:, :, :n].repeat_interleave(g, 1), v[:, :, :n].repeat_interleave(g, 1),
                                            is_causal=True).transpose(1, 2)
    assert torch.allclose(slot_attention(None, q, k[:, :, :n], v[:, :, :n], None)[0], square, atol=1e-6)


def test_arguments_it_would_ignore_are_refused():
    q = k = v = torch.zeros(1, 2, 3, 4)
    for extra in ({"softcap": 30.0}, {"s_aux": torch.zeros(2)}, {"sliding_window": 128}, {"dropout": 0.1}):
        with pytest.raises(ValueError, match="does not implement"):
            slot_attention(None, q, k, v, None, **extra)
    assert slot_attention(None, q, k, v, None, sliding_window=None, softcap=None)[0].shape == (1, 3, 2, 4)


def test_engine_greedy_tokens_unchanged(tiny_kind, tiny_models):
    model = tiny_models(tiny_kind)
    prompts = _prompts()
    with using_slot_attention(model):
        got = SpecEngine(model, None, read_len="max").generate(prompts, 20).tokens
    assert got == [_hf_greedy(model, p, 20) for p in prompts]


def test_the_models_attention_comes_back(tiny_models):
    model = tiny_models("llama")
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="inside"):
        with using_slot_attention(model):
            assert model.config._attn_implementation == NAME
            raise RuntimeError("inside")
    assert model.config._attn_implementation == before
    with using_slot_attention(model, enabled=False):
        assert model.config._attn_implementation == before


def test_unknown_attention_is_refused(tiny_models):
    from outrider.errors import UserError

    model = tiny_models("llama")
    with pytest.raises(UserError, match="attention must be"):
        SpecEngine(model, None, attention="flash")
    with pytest.raises(ValueError, match="attention must be"):
        CachedLM(model, 1, 16, attention="flash")
