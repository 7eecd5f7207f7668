"""The trainer's FLOP counts against torch's own counter of the products a forward runs."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tiny
from torch.utils.flop_counter import FlopCounterMode

from outrider.heads.eagle3 import Eagle3Config
from outrider.train.loop import flops


def test_causal_pairs():
    assert flops.causal_pairs([1, 2, 3]) == 1 + 3 + 6 and flops.causal_pairs([]) == 0


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])  # dense GQA; MLA with routed and shared experts
def test_target_flops_equal_the_counted_products_of_a_forward(kind):
    model = make_tiny(kind)
    model.set_attn_implementation("eager")  # attention as matrix products the counter sees
    model.set_experts_implementation({k: "eager" for k in model.get_experts_implementation()})  # ditto the experts
    T = 10
    decoder = model.get_decoder()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        decoder(input_ids=torch.randint(3, 90, (1, T)))
    weights = flops.target_flops_per_token(decoder, model.get_input_embeddings().parameters(), 0, model.config) * T
    attention = flops.target_attention_flops(model.config, flops.causal_pairs([T]))
    # eager attention multiplies all T x T pairs and masks after: T^2 against our T (T + 1) / 2
    assert weights + attention * 2 * T / (T + 1) == pytest.approx(counter.get_total_flops(), rel=1e-9)
    if kind == "deepseek_v3":  # routed experts at their top-k share: all of them would count more
        dense = flops.target_flops_per_token(decoder, model.get_input_embeddings().parameters(), 0,
                                             model.config.to_dict() | {"n_routed_experts": 0})
        assert dense * T > weights


def test_head_attention_counts_the_diagonal_keys_of_each_unrolled_step():
    cfg = Eagle3Config.for_target(make_tiny("llama").config, 50)
    assert cfg.num_attention_heads * cfg.head_dim == 64
    one = flops.head_attention_flops(cfg, tokens=10, pairs=55, steps=1)
    assert one == 6 * 2 * 55 * 64  # forward + backward of q k^T and p v over the causal pairs
    assert flops.head_attention_flops(cfg, 10, 55, 3) == 3 * one + 6 * 2 * (1 + 2) * 10 * 64
    assert flops.head_flops(body=7, lm=3, tokens=10, counted=4.0, steps=2) == 6 * 7 * 10 * 2 + 6 * 3 * 4
