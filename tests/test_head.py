"""EAGLE-3 head: exact state-dict names and shapes, config, and cached forward == full forward."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_config

from outrider.decode.kv_cache import SlotCache
from outrider.errors import UserError
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.train.data.vocab import build_draft_vocab

EXPECTED = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def _head(kind="llama", draft=40, seed=0, std=0.2):
    cfg = Eagle3Config.for_target(tiny_config(kind, layers=6), draft)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():  # larger weights than the training init: attention patterns matter
        for name, p in head.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, std)
    return head.eval()


def test_state_dict_names_and_shapes(tiny_models):
    target = tiny_models("llama")
    head = _head()
    head.bind_embedding(target.get_input_embeddings())
    sd = head.state_dict()
    assert set(sd) == EXPECTED
    H, d = 64, 16
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * d, 2 * H)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * d, 2 * H)  # GQA: 2 kv heads, as the target
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (H, 4 * d)
    assert sd["midlayer.mlp.gate_proj.weight"].shape == (128, H)
    assert sd["lm_head.weight"].shape == (40, H)
    assert sd["d2t"].dtype == torch.long and sd["d2t"].shape == (40,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (96,)
    assert not any(p is target.get_input_embeddings().weight for p in head.parameters())
    ids = torch.tensor([[3, 7, 9]])
    assert torch.equal(head.embed(ids), target.get_input_embeddings()(ids))


def test_fuse_is_fc():
    head = _head()
    aux = torch.randn(2, 5, 3 * 64)
    assert torch.allclose(head.fuse(aux), aux @ head.fc.weight.T, atol=1e-6)


def test_config_for_target_and_round_trip():
    llama = Eagle3Config.for_target(tiny_config("llama", layers=30), 50)
    assert llama.aux_layer_ids == (2, 15, 27)
    assert (llama.hidden_size, llama.target_hidden_size, llama.num_key_value_heads, llama.head_dim) == (64, 64, 2, 16)
    assert (llama.vocab_size, llama.draft_vocab_size, llama.max_position_embeddings) == (96, 50, 1024)
    assert Eagle3Config.from_dict(llama.to_dict()) == llama
    mla = Eagle3Config.for_target(tiny_config("deepseek_v3", layers=6), 50, aux_layer_ids=(1, 3, 5))
    assert mla.aux_layer_ids == (1, 3, 5)
    assert (mla.num_attention_heads, mla.num_key_value_heads, mla.head_dim) == (4, 4, 16)  # MLA -> plain MHA, H/heads
    kimi_like = {"model_type": "kimi_k2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 8,
                 "vocab_size": 96, "intermediate_size": 128, "kv_lora_rank": 16, "rms_norm_eps": 1e-5,
                 "max_position_embeddings": 8192, "rope_theta": 50000.0,
                 "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    k = Eagle3Config.for_target({"model_type": "kimi_k25", "text_config": kimi_like}, 32)
    assert k.rope_theta == 50000.0 and k.rope_scaling["rope_type"] == "yarn" and "type" not in k.rope_scaling
    assert k.aux_layer_ids == (2, 4, 5) and k.rms_norm_eps == 1e-5
    Eagle3Head(k)  # the yarn rotary builds
    assert Eagle3Config.for_target(tiny_config("llama", layers=6), 50, aux_layer_ids=(1, 2, 6)).aux_layer_ids[-1] == 6
    with pytest.raises(UserError, match="out of range"):  # 6 = the last layer's output; 7 is no state
        Eagle3Config.for_target(tiny_config("llama", layers=6), 50, aux_layer_ids=(1, 2, 7))
    with pytest.raises(UserError):
        Eagle3Config.for_target(tiny_config("llama", layers=6), 97)


def test_rotary_stays_float32_when_cast():
    head = _head().to(torch.bfloat16)
    assert head.rotary.inv_freq.dtype == torch.float32
    assert head.fc.weight.dtype == torch.bfloat16


def test_vocab_buffers_and_map_to_target():
    head = _head()
    vocab = build_draft_vocab(torch.arange(96) % 7 + (torch.arange(96) == 50) * 100, 96, 40)
    head.set_vocab(vocab.d2t, vocab.t2d)
    draft = torch.arange(40)
    assert torch.equal(head.map_to_target(draft), vocab.draft_ids)
    assert torch.equal(head.t2d, vocab.t2d)
    with pytest.raises(UserError):
        head.set_vocab(vocab.d2t[:-1], vocab.t2d)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_cached_chunks_equal_full_causal_forward(kind):
    head = _head(kind)
    B, S, H = 2, 16, 64
    g = torch.Generator().manual_seed(1)
    emb, hid = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    pos = torch.arange(S).expand(B, S)
    with torch.no_grad():
        full_logits, full_hidden = head(emb, hid, pos)
        cache = SlotCache(1, B, S, "cpu")
        start, logits, hiddens = 0, [], []
        for n in (5, 1, 3, 7):
            cache.begin(n)
            mask = cache.attention_mask(torch.ones(B, n, dtype=torch.bool),
                                        torch.ones(n, n, dtype=torch.bool).tril(), torch.float32)
            lg, h = head(emb[:, start:start + n], hid[:, start:start + n], pos[:, start:start + n], mask, cache)
            cache.commit(torch.ones(B, n, dtype=torch.bool))
            logits.append(lg)
            hiddens.append(h)
            start += n
    torch.testing.assert_close(torch.cat(logits, 1), full_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(hiddens, 1), full_hidden, atol=1e-4, rtol=1e-4)


def test_rejected_slots_are_invisible():
    """Draft 3 tokens, keep 1: the next step equals a full forward over the kept tokens only."""
    head = _head()
    B, H = 1, 64
    g = torch.Generator().manual_seed(2)
    emb, hid = torch.randn(B, 9, H, generator=g), torch.randn(B, 9, H, generator=g)
    with torch.no_grad():
        cache = SlotCache(1, B, 32, "cpu")

        def step(e, h, pos, keep):
            n = e.shape[1]
            cache.begin(n)
            mask = cache.attention_mask(torch.ones(B, n, dtype=torch.bool),
                                        torch.ones(n, n, dtype=torch.bool).tril(), torch.float32)
            out = head(e, h, pos, mask, cache)
            cache.commit(keep)
            return out

        step(emb[:, :4], hid[:, :4], torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool))
        step(emb[:, 4:7], hid[:, 4:7], torch.arange(4, 7)[None], torch.tensor([[True, False, False]]))
        lg, h = step(emb[:, 7:9], hid[:, 7:9], torch.arange(5, 7)[None], torch.ones(1, 2, dtype=torch.bool))
        keep = [0, 1, 2, 3, 4, 7, 8]
        ref_lg, ref_h = head(emb[:, keep], hid[:, keep], torch.arange(7)[None])
    torch.testing.assert_close(lg, ref_lg[:, 5:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h, ref_h[:, 5:], atol=1e-4, rtol=1e-4)


def test_bool_and_additive_masks_agree():
    head = _head()
    B, S, H = 2, 6, 64
    emb, hid = torch.randn(B, S, H), torch.randn(B, S, H)
    allowed = torch.rand(B, 1, S, S) < 0.5
    allowed |= torch.eye(S, dtype=torch.bool)
    additive = torch.zeros(B, 1, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
    pos = torch.arange(S).expand(B, S)
    with torch.no_grad():
        a = head(emb, hid, pos, allowed)[0]
        b = head(emb, hid, pos, additive)[0]
        c = head(emb, hid, pos)[0]
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a, c, atol=1e-3)  # the mask matters
