"""MLA heads and the EAGLE 3.1 options: the attention against transformers' DeepSeek-V3 layer, TTT
against a slow explicit reference, drafting equal to training, lossless decoding, aux id L."""

from __future__ import annotations

import pytest
import torch
from tiny import assert_rounds_are_the_ttt_unroll, make_tiny, tiny_config
from torch.nn import functional as F

from outrider.decode.engine import SpecEngine
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.decode.proposers.head_cache import HeadCache
from outrider.errors import UserError
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.models import AuxCapture
from outrider.train.loop.ttt import ttt_loss, ttt_step_mask

VD = 40
# (target kind, head attention, options): MLA heads with and without the 3.1 norms, a windowed GQA head
CASES = [("llama", "mla", {}),
         ("deepseek_v3", "mla", {"fc_norm": True, "norm_output": True, "norm_before_residual": True}),
         ("llama", "gqa", {"norm_before_fc": True, "norm_output": True, "sliding_window": 3})]


def _head(kind="llama", attention="mla", seed=0, std=0.2, aux=(1, 2, 3), **options) -> Eagle3Head:
    cfg = Eagle3Config.for_target(tiny_config(kind, layers=4), VD, aux_layer_ids=aux, attention=attention, **options)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, std)  # norms away from 1: a misplaced norm shows
    return head


# ---------------------------------------------------------------------------------------------
# The attention against transformers' DeepSeek-V3 MLA (the engines' conventions: interleaved rope,
# YaRN, mscale in the softmax scale)


def test_mla_attention_equals_transformers_deepseek_v3_attention():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    yarn = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    target = dict(tiny_config("deepseek_v3").to_dict(), rope_parameters={**yarn, "rope_theta": 50000.0},
                  rms_norm_eps=1e-6, max_position_embeddings=256)
    cfg = Eagle3Config.for_target(target, VD, (1, 2, 3), attention="mla")
    assert cfg.rope_scaling["rope_type"] == "yarn"
    torch.manual_seed(3)
    head = Eagle3Head(cfg)
    attn = head.midlayer.self_attn
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.3)
    H = cfg.hidden_size
    # transformers' layer over a 2H-wide input; its o_proj maps to 2H: ours in the first H rows, zeros below
    hf_cfg = DeepseekV3Config(hidden_size=2 * H, num_attention_heads=cfg.num_attention_heads,
                              num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                              kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                              qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                              rope_scaling=yarn, rope_theta=50000.0, max_position_embeddings=256,
                              rope_interleave=True, attention_bias=False)
    hf_cfg._attn_implementation = "eager"
    ref = DeepseekV3Attention(hf_cfg, 0).eval()
    with torch.no_grad():
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"):
            getattr(ref, name).weight.copy_(getattr(attn, name).weight)
        ref.o_proj.weight.copy_(torch.cat([attn.o_proj.weight, torch.zeros_like(attn.o_proj.weight)]))
    assert ref.scaling == pytest.approx(attn.scaling) and attn.scaling > (cfg.head_dim ** -0.5) * 1.1  # mscale^2
    B, n = 2, 9
    x = torch.randn(B, n, 2 * H)
    pos = torch.arange(40, 40 + n)[None].expand(B, n)  # past the original context: YaRN's ramp matters
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        cos, sin = head.rotary(pos, x.dtype)
        ours = attn(x, cos, sin, None, None)
        theirs, _ = ref(x, DeepseekV3RotaryEmbedding(hf_cfg)(x, pos), causal)
    torch.testing.assert_close(ours, theirs[..., :H], atol=1e-5, rtol=1e-5)


def test_mla_config_defaults_and_refusals():
    kimi = {"model_type": "kimi_k2", "hidden_size": 7168, "num_attention_heads": 64, "num_hidden_layers": 61,
            "vocab_size": 163840, "intermediate_size": 18432, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 128,
            "max_position_embeddings": 262144}
    cfg = Eagle3Config.for_target(kimi, 32000, attention="mla")
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert cfg.head_dim == 192 and cfg.num_key_value_heads == 64 and cfg.aux_layer_ids == (2, 30, 58)
    assert Eagle3Config.from_dict(cfg.to_dict()) == cfg
    smol = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
            "num_hidden_layers": 30, "vocab_size": 49152, "intermediate_size": 1536}
    own = Eagle3Config.for_target(smol, 100, attention="mla")  # a GQA target: sizes from its head width 64
    assert (own.q_lora_rank, own.kv_lora_rank, own.qk_nope_head_dim, own.qk_rope_head_dim, own.v_head_dim) == \
        (576, 256, 64, 32, 64)
    with pytest.raises(UserError, match="sliding window"):
        Eagle3Config.for_target(kimi, 32000, attention="mla", sliding_window=2048)
    with pytest.raises(UserError, match="q_lora_rank"):
        Eagle3Config.for_target(kimi, 32000, attention="mla", q_lora_rank=0)
    with pytest.raises(UserError, match="exclude each other"):
        Eagle3Config.for_target(smol, 100, fc_norm=True, norm_before_fc=True)
    with pytest.raises(UserError, match="unknown head option"):
        Eagle3Config.for_target(smol, 100, fc_norms=True)


# ---------------------------------------------------------------------------------------------
# TTT against a slow explicit reference: every query over exactly the keys it may see, one by one


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _inv_freq(d, theta):
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def _rope_halves(x, pos, theta):  # Llama: (x_i, x_{i+d/2}) rotated together
    d = x.shape[-1]
    ang = pos * _inv_freq(d, theta)
    x1, x2 = x[: d // 2], x[d // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()])


def _rope_pairs(x, pos, theta):  # DeepSeek / GPT-J: (x_{2i}, x_{2i+1}) rotated together
    ang = pos * _inv_freq(x.shape[-1], theta)
    out = x.clone()
    out[0::2] = x[0::2] * ang.cos() - x[1::2] * ang.sin()
    out[1::2] = x[1::2] * ang.cos() + x[0::2] * ang.sin()
    return out


def _qkv(head, x, pos):
    """One token's q [heads, d], k [kv, d], v [kv, d_v] from its 2H-wide input x, explicitly."""
    c, A = head.config, head.midlayer.self_attn
    if c.attention == "gqa":
        d = c.head_dim
        q = (A.q_proj.weight @ x).view(-1, d)
        k = (A.k_proj.weight @ x).view(-1, d)
        v = (A.v_proj.weight @ x).view(-1, d)
        return (torch.stack([_rope_halves(r, pos, c.rope_theta) for r in q]),
                torch.stack([_rope_halves(r, pos, c.rope_theta) for r in k]), v)
    dn, dr, dv, eps = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.rms_norm_eps
    q = (A.q_b_proj.weight @ _rms(A.q_a_proj.weight @ x, A.q_a_layernorm.weight, eps)).view(-1, dn + dr)
    kv = A.kv_a_proj_with_mqa.weight @ x
    latent, k_rope = _rms(kv[: c.kv_lora_rank], A.kv_a_layernorm.weight, eps), _rope_pairs(kv[c.kv_lora_rank:], pos,
                                                                                             c.rope_theta)
    kvb = (A.kv_b_proj.weight @ latent).view(-1, dn + dv)
    q = torch.cat([q[:, :dn], torch.stack([_rope_pairs(r, pos, c.rope_theta) for r in q[:, dn:]])], dim=-1)
    k = torch.cat([kvb[:, :dn], k_rope.expand(kvb.shape[0], dr)], dim=-1)
    return q, k, kvb[:, dn:]


def reference(head, embed, aux, ids, loss_mask, teacher, real, steps, weights):
    c, L = head.config, head.midlayer
    eps, W = c.rms_norm_eps, c.sliding_window
    B, S = ids.shape
    scale = c.head_dim ** -0.5  # no YaRN here: the MLA scale is (nope + rope) ** -0.5 too
    g = c.num_attention_heads // c.num_key_value_heads
    real = real.bool()
    E = embed(ids)
    pos = (real.long().cumsum(-1) - 1).clamp_min(0)
    a = aux
    if c.norm_before_fc:
        a = _rms(a, head.input_norm.weight, eps)
    if c.fc_norm:
        a = torch.cat([_rms(ch, n.weight, eps) for ch, n in zip(a.chunk(3, -1), head.fc_norm)], -1)
    h_in = a @ head.fc.weight.T
    K, V, losses, accs, total = {}, {}, [], [], 0.0
    for i in range(steps):
        out, Q = torch.zeros(B, S, c.hidden_size), {}
        for b in range(B):
            for t in range(S):  # token x_{t+1+i} (zeros past the end) at position pos_t + i
                e = E[b, t + 1 + i] if t + 1 + i < S else torch.zeros(c.hidden_size)
                x = torch.cat([_rms(e, L.input_layernorm.weight, eps), _rms(h_in[b, t], L.hidden_norm.weight, eps)])
                Q[b, t], K[i, b, t], V[i, b, t] = _qkv(head, x, pos[b, t] + i)
        for b in range(B):
            for t in range(S):
                q = Q[b, t]
                seen = [(0, s) for s in range(t + 1) if (bool(real[b, s]) or s == t) and (not W or t + i - s < W)]
                seen += [(j, t) for j in range(1, i + 1) if not W or i - j < W]
                heads = []
                for hh in range(c.num_attention_heads):
                    keys = torch.stack([K[j, b, s][hh // g] for j, s in seen])
                    vals = torch.stack([V[j, b, s][hh // g] for j, s in seen])
                    heads.append(torch.softmax(keys @ q[hh] * scale, 0) @ vals)
                residual = _rms(h_in[b, t], L.hidden_norm.weight, eps) if c.norm_before_residual else h_in[b, t]
                hh_ = residual + L.self_attn.o_proj.weight @ torch.cat(heads)
                m = _rms(hh_, L.post_attention_layernorm.weight, eps)
                mlp = L.mlp
                out[b, t] = hh_ + mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ m) * (mlp.up_proj.weight @ m))
        normed = _rms(out, head.norm.weight, eps)
        h_in = normed if c.norm_output else out
        logits = normed @ head.lm_head.weight.T
        ces, hits = [], []
        for b in range(B):
            for t in range(S):
                u = t + 2 + i
                if u < S and loss_mask[b, u] and real[b, u] and real[b, t]:
                    p = torch.softmax(teacher[b, u - 1], -1)
                    ces.append(-(p * torch.log_softmax(logits[b, t], -1)).sum())
                    hits.append(float(logits[b, t].argmax() == teacher[b, u - 1].argmax()))
        step = torch.stack(ces).mean()
        losses.append(step)
        accs.append(sum(hits) / len(hits))
        total = total + weights[i] * step
    return total, torch.stack(losses), torch.tensor(accs)


def _inputs(B=3, S=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (B, S), generator=g)
    real = torch.ones(B, S, dtype=torch.bool)
    real[1, 6:] = False  # right padding
    real[2, :2] = False  # left padding
    loss_mask = (torch.rand(B, S, generator=g) < 0.8) & real
    aux = 2 * torch.randn(B, S, 3 * 64, generator=g)
    teacher = 3 * torch.randn(B, S, VD, generator=g)
    embed = torch.nn.Embedding(96, 64).requires_grad_(False)
    return embed, aux, ids, loss_mask.long(), teacher, real.long()


@pytest.mark.parametrize("kind, attention, options", CASES)
def test_ttt_matches_the_slow_reference(kind, attention, options):
    head = _head(kind, attention, seed=1, **options)
    embed, aux, ids, loss_mask, teacher, real = _inputs(seed=2)
    steps, weights = 3, [0.8 ** i for i in range(3)]
    out = ttt_loss(head, embed, aux, ids, loss_mask, teacher, real, steps=steps)
    with torch.no_grad():
        ref_total, ref_steps, ref_acc = reference(head, embed, aux, ids, loss_mask, teacher, real, steps, weights)
    torch.testing.assert_close(out.loss.detach(), ref_total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.per_step_loss, ref_steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.per_step_acc, ref_acc.float(), atol=1e-6, rtol=0)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    # flex attention (forward only on the CPU) on the right-padded rows gives the dense loss
    right = real.clone()
    right[2] = 1
    with torch.no_grad():
        flex = ttt_loss(head, embed, aux, ids, loss_mask * right, teacher, right, steps=steps, attention="flex")
        dense = ttt_loss(head, embed, aux, ids, loss_mask * right, teacher, right, steps=steps)
    torch.testing.assert_close(flex.loss, dense.loss, atol=1e-5, rtol=1e-5)
    assert flex.per_step_correct.tolist() == dense.per_step_correct.tolist()


def test_windowed_step_mask_is_exactly_the_allowed_keys():
    real = torch.tensor([[True] * 6, [False, True, True, True, True, True]])
    for step in range(4):
        mask = ttt_step_mask(real, step, window=2)
        for b in range(2):
            for t in range(6):
                for col in range((step + 1) * 6):
                    j, s = divmod(col, 6)
                    if j == 0:
                        allowed = s <= t and (bool(real[b, s]) or s == t) and t + step - s < 2
                    else:
                        allowed = s == t and step - j < 2
                    assert bool(mask[b, 0, t, col]) == allowed, (step, b, t, j, s)


def test_head_cache_window_hides_old_slots():
    cache = HeadCache(1, 20, 2, 8, torch.float32, torch.device("cpu"), v_head_dim=4, window=3)
    assert cache.values.shape[-1] == 4 and cache.keys.shape[-1] == 8
    mask = cache.mask(torch.tensor([[7]]), torch.tensor([[True]]))[0, 0, 0]
    assert mask.nonzero().flatten().tolist() == [5, 6, 7]


# ---------------------------------------------------------------------------------------------
# Drafting: lossless, and the chain is the training unroll


def _vocab_head(model, attention, seed=0, **options):
    cfg = Eagle3Config.for_target(model.config, 64, aux_layer_ids=(0, 1, 2), attention=attention, **options)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    V = model.config.vocab_size
    kept = torch.randperm(V)[:64].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    head.set_vocab(kept - torch.arange(64), t2d)
    return head.eval().requires_grad_(False)


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(5, 90, (n,), generator=g).tolist() for n in (5, 11, 3)]


@pytest.mark.parametrize("kind, attention, options", CASES + [("deepseek_v3", "mla", {})])
def test_greedy_decoding_is_lossless(tiny_models, kind, attention, options):
    model = tiny_models(kind)
    prompts = _prompts()
    refs = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]
    engine = SpecEngine(model, Eagle3Proposer(_vocab_head(model, attention, **options), model), k=3)
    assert engine.generate(prompts, 16).tokens == refs


@pytest.mark.parametrize("kind, attention, options", [CASES[1], CASES[2]])
def test_the_drafted_chain_is_the_training_unroll(tiny_models, kind, attention, options):
    """Every draft of every round is what TTT predicts at the round's position (MLA with the 3.1 norms;
    a windowed GQA head whose window the prompts outgrow): drafting and training are one computation."""
    model = tiny_models(kind)
    head, k = _vocab_head(model, attention, seed=2, **options), 3
    proposer = Eagle3Proposer(head, model)
    rounds, propose = [], proposer.propose

    def recording(n):
        draft = propose(n)
        rounds.append((list(proposer.ctx.histories[0]), draft.tokens[0].tolist()))
        return draft

    proposer.propose = recording
    SpecEngine(model, proposer, k=k).generate(_prompts()[1:2], 14)
    assert_rounds_are_the_ttt_unroll(model, head, rounds, k)


# ---------------------------------------------------------------------------------------------
# Aux id L: the last layer's output, before the final norm


def test_aux_id_L_is_the_last_layers_output_before_the_final_norm():
    model = make_tiny("llama", layers=4)
    seen = []
    hook = model.model.norm.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        with AuxCapture(model, (1, 2, 4)) as cap, torch.no_grad():
            model(torch.tensor([[5, 6, 7, 8]]))
            states = dict(cap.states)
    finally:
        hook.remove()
    assert torch.equal(states[4], seen[0]) and not torch.equal(states[4], states[2])
    with pytest.raises(UserError, match="out of range"):
        AuxCapture(model, (1, 2, 5))
    assert Eagle3Config.for_target(model.config, 64, aux_layer_ids=(1, 2, 4)).aux_layer_ids == (1, 2, 4)


@pytest.mark.parametrize("kind, attention, options", [CASES[1], CASES[2]])
def test_compiled_steps_and_device_rounds_draft_what_eager_steps_draft(tiny_models, kind, attention, options):
    """The fused draft step (torch.compile, aot_eager: eager kernels) and the device rounds over the static
    slot cache draft exactly the eager chain's tokens, for MLA heads and windowed heads too."""
    model = tiny_models(kind)
    drafts = {}
    for mode in ("eager", "compiled", "rounds"):
        proposer = Eagle3Proposer(_vocab_head(model, attention, seed=3, **options), model)
        seen, propose = [], proposer.propose

        def recording(n, propose=propose, seen=seen):
            draft = propose(n)
            seen.append(draft.tokens.tolist())
            return draft

        proposer.propose = recording
        kwargs = {"eager": dict(read_len="max", rounds=0), "compiled": dict(compile="aot_eager", read_len="max", rounds=0),
                  "rounds": dict(read_len="max")}[mode]
        out = SpecEngine(model, proposer, k=3, **kwargs).generate(_prompts()[:2], 14)
        drafts[mode] = seen, out.tokens
    assert len(drafts["eager"][0]) > 3
    assert drafts["compiled"] == drafts["eager"]
    assert drafts["rounds"][1] == drafts["eager"][1]  # device rounds draft inside the round: same output


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind, attention, options", [CASES[1], CASES[2]])
def test_cuda_graphs_draft_losslessly(tiny_models, kind, attention, options, compile):
    import copy

    model = copy.deepcopy(tiny_models(kind)).to("cuda")
    prompts = _prompts()
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = SpecEngine(model, Eagle3Proposer(_vocab_head(model, attention, **options).cuda(), model), k=3,
                        graphs=True, compile=compile)
    for _ in range(2):  # the second pass replays the graphs of the first
        assert engine.generate(prompts[:1], 16).tokens + engine.generate(prompts[1:], 16).tokens == refs


@pytest.mark.gpu
@pytest.mark.parametrize("kind, attention, options", [CASES[0], CASES[2]])
def test_cuda_flex_ttt_gives_the_dense_gradients(kind, attention, options):
    """flex_attention (compiled on CUDA) over MLA keys and values of different widths, and with a window."""
    embed, aux, ids, loss_mask, teacher, real = _inputs(B=3, S=200, seed=7)
    right = torch.ones_like(real)
    right[1, 163:] = 0
    loss_mask = loss_mask * right
    results = {}
    for attention_impl in ("dense", "flex"):
        head = _head(kind, attention, seed=4, **options).to("cuda")
        out = ttt_loss(head, embed.to("cuda"), aux.to("cuda"), ids.to("cuda"), loss_mask.to("cuda"),
                       teacher.to("cuda"), right.to("cuda"), steps=5, attention=attention_impl)
        out.loss.backward()
        results[attention_impl] = out.loss.detach(), {n: p.grad for n, p in head.named_parameters()}
    (dense_loss, dense_grads), (flex_loss, flex_grads) = results["dense"], results["flex"]
    torch.testing.assert_close(flex_loss, dense_loss, atol=1e-5, rtol=1e-5)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
