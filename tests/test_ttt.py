"""TTT: block mask and loss against a slow explicit reference; weighting; gradients; a training sanity run."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import make_tiny, tiny_config
from torch.nn import functional as F

from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.train.states.capture import TargetCapture
from outrider.train.loop.ttt import (
    TTTModule,
    counted_positions,
    simulated_accept_len,
    ttt_block_mask,
    ttt_loss,
    walked_accept_len,
)
from outrider.train.data.vocab import build_draft_vocab

VD = 40


def _head(seed=0, std=0.2):
    cfg = Eagle3Config.for_target(tiny_config("llama", layers=4), VD, aux_layer_ids=(1, 2, 3))
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, std)
    return head


def _inputs(B=3, S=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (B, S), generator=g)
    real = torch.ones(B, S, dtype=torch.bool)
    real[1, 7:] = False  # right padding
    real[2, :2] = False  # left padding
    loss_mask = (torch.rand(B, S, generator=g) < 0.8) & real
    aux = torch.randn(B, S, 3 * 64, generator=g)
    teacher = 3 * torch.randn(B, S, VD, generator=g)
    embed = torch.nn.Embedding(96, 64).requires_grad_(False)
    return embed, aux, ids, loss_mask.long(), teacher, real.long()


# ---------------------------------------------------------------------------------------------
# The slow reference: every query's attention over exactly the keys it may see, one by one.


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):
    d = x.shape[-1]
    ang = pos * (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    return x * cos + torch.cat([-x[d // 2:], x[: d // 2]]) * sin


def reference(head, embed, aux, ids, loss_mask, teacher, real, steps, weights):
    c, L = head.config, head.midlayer
    A = L.self_attn
    B, S = ids.shape
    nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    real = real.bool()
    E = embed(ids)
    pos = (real.long().cumsum(-1) - 1).clamp_min(0)
    h_in = aux @ head.fc.weight.T
    K, Vs, losses, accs, total = [], [], [], [], 0.0
    for i in range(steps):
        tok = torch.zeros_like(E)
        for t in range(S):
            if t + 1 + i < S:
                tok[:, t] = E[:, t + 1 + i]
        x = torch.cat([_rms(tok, L.input_layernorm.weight, c.rms_norm_eps),
                       _rms(h_in, L.hidden_norm.weight, c.rms_norm_eps)], -1)
        q = (x @ A.q_proj.weight.T).view(B, S, nh, d)
        k = (x @ A.k_proj.weight.T).view(B, S, nkv, d)
        v = (x @ A.v_proj.weight.T).view(B, S, nkv, d)
        q = torch.stack([torch.stack([torch.stack([_rope(q[b, t, hh], pos[b, t] + i, c.rope_theta)
                                                   for hh in range(nh)]) for t in range(S)]) for b in range(B)])
        k = torch.stack([torch.stack([torch.stack([_rope(k[b, t, hh], pos[b, t] + i, c.rope_theta)
                                                   for hh in range(nkv)]) for t in range(S)]) for b in range(B)])
        K.append(k)
        Vs.append(v)
        attn = torch.zeros(B, S, nh, d)
        for b in range(B):
            for t in range(S):
                for hh in range(nh):
                    kh = hh // (nh // nkv)
                    keys = [K[0][b, s, kh] for s in range(t + 1) if real[b, s] or s == t]
                    vals = [Vs[0][b, s, kh] for s in range(t + 1) if real[b, s] or s == t]
                    keys += [K[j][b, t, kh] for j in range(1, i + 1)]
                    vals += [Vs[j][b, t, kh] for j in range(1, i + 1)]
                    p = torch.softmax(torch.stack(keys) @ q[b, t, hh] / math.sqrt(d), dim=0)
                    attn[b, t, hh] = p @ torch.stack(vals)
        h = h_in + attn.reshape(B, S, nh * d) @ A.o_proj.weight.T
        m = _rms(h, L.post_attention_layernorm.weight, c.rms_norm_eps)
        h = h + (F.silu(m @ L.mlp.gate_proj.weight.T) * (m @ L.mlp.up_proj.weight.T)) @ L.mlp.down_proj.weight.T
        h_in = h
        logits = _rms(h, head.norm.weight, c.rms_norm_eps) @ head.lm_head.weight.T
        ces, hits = [], []
        for b in range(B):
            for t in range(S):
                u = t + 2 + i  # the token this prediction is of
                if u < S and loss_mask[b, u] and real[b, u] and real[b, t]:
                    p = torch.softmax(teacher[b, u - 1], -1)
                    ces.append(-(p * torch.log_softmax(logits[b, t], -1)).sum())
                    hits.append(float(logits[b, t].argmax() == teacher[b, u - 1].argmax()))
        step = torch.stack(ces).mean()
        losses.append(step)
        accs.append(sum(hits) / len(hits))
        total = total + weights[i] * step
    return total, torch.stack(losses), torch.tensor(accs)


# ---------------------------------------------------------------------------------------------


def test_block_mask_is_exactly_the_allowed_keys():
    real = torch.tensor([[True] * 5, [False, True, True, True, True], [True, True, True, False, False]])
    steps = 3
    mask = ttt_block_mask(real, steps)
    B, S = real.shape
    assert mask.shape == (B, 1, S, steps * S)
    for b in range(B):
        for t in range(S):
            for col in range(steps * S):
                j, s = divmod(col, S)
                allowed = (s <= t and (bool(real[b, s]) or s == t)) if j == 0 else s == t
                assert bool(mask[b, 0, t, col]) == allowed, (b, t, j, s)


def test_loss_matches_slow_reference():
    torch.set_default_dtype(torch.float32)
    head = _head()
    embed, aux, ids, loss_mask, teacher, real = _inputs()
    steps, weights = 4, [0.8 ** i for i in range(4)]
    out = ttt_loss(head, embed, aux, ids, loss_mask, teacher, real, steps=steps)
    with torch.no_grad():
        ref_total, ref_steps, ref_acc = reference(head, embed, aux, ids, loss_mask, teacher, real, steps, weights)
    torch.testing.assert_close(out.loss.detach(), ref_total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.per_step_loss, ref_steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.per_step_acc, ref_acc.float(), atol=1e-6, rtol=0)
    # counted positions: x_{t+2+i} exists, is real and loss-masked, and t is real
    lm, r = loss_mask.bool(), real.bool()
    want = [int((lm[:, 2 + i:] & r[:, 2 + i:] & r[:, : 10 - 2 - i]).sum()) for i in range(steps)]
    assert out.per_step_tokens.tolist() == want and out.n_tokens == want[0]
    torch.testing.assert_close(out.per_step_acc, out.per_step_correct.float() / out.per_step_tokens.float())
    # positions found ahead of the call (as the trainer does, on the host) give the same loss and metrics
    index = counted_positions(loss_mask, real, steps)
    assert [len(b) for b, _ in index] == want
    given = ttt_loss(head, embed, aux, ids, loss_mask, teacher, real, steps=steps, index=index)
    torch.testing.assert_close(given.loss, out.loss, atol=0, rtol=0)
    assert given.per_step_correct.tolist() == out.per_step_correct.tolist()
    with pytest.raises(ValueError):
        ttt_loss(head, embed, aux, ids, loss_mask, teacher, real, steps=steps, index=index[:2])
    # the agreement map holds the same agreements, at counted positions only
    mapped = ttt_loss(head, embed, aux, ids, loss_mask, teacher, real, steps=steps, agree_map=True)
    assert out.agree is None and mapped.agree.shape == (steps, *ids.shape)
    assert mapped.agree.sum((1, 2)).tolist() == out.per_step_correct.tolist()
    for i, (b, t) in enumerate(index):
        counted = torch.zeros_like(ids, dtype=torch.bool)
        counted[b, t] = True
        assert not (mapped.agree[i] & ~counted).any()


def test_flex_attention_gives_the_dense_loss_on_right_padded_batches():
    """``attention="flex"`` (forward only here: flex_attention has no backward on the CPU; the
    GPU suite trains with it) against the slow reference, and its padding guard."""
    head = _head(seed=4)
    embed, aux, ids, loss_mask, teacher, real = _inputs(seed=5)
    right = real.clone()
    right[2] = 1  # rows 0 and 1 only: full, right-padded
    loss_mask = loss_mask * right
    steps, weights = 4, [0.8 ** i for i in range(4)]
    with torch.no_grad():
        got = ttt_loss(head, embed, aux, ids, loss_mask, teacher, right, steps=steps, attention="flex")
        ref_total, ref_steps, ref_acc = reference(head, embed, aux, ids, loss_mask, teacher, right, steps, weights)
        dense = ttt_loss(head, embed, aux, ids, loss_mask, teacher, right, steps=steps)
    torch.testing.assert_close(got.loss, ref_total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.per_step_loss, ref_steps, atol=1e-5, rtol=1e-5)
    assert got.per_step_correct.tolist() == dense.per_step_correct.tolist()
    torch.testing.assert_close(got.per_step_acc, ref_acc.float(), atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError), torch.no_grad():  # row 2 left-padded: a real query would see padding
        ttt_loss(head, embed, aux, ids, loss_mask, teacher, real, steps=steps, attention="flex")
    with pytest.raises(ValueError, match="attention"):
        ttt_loss(head, embed, aux, ids, loss_mask, teacher, right, steps=steps, attention="sparse")


def test_walked_acceptance_length_decodes_each_span_round_by_round():
    ok = torch.zeros(3, 3, 12, dtype=torch.bool)  # [steps, batch, S]
    mask = torch.zeros(3, 12, dtype=torch.long)
    # row 0: one span x_4..x_11; rounds start at t = 3 (accepts 2), 6 (0), 7 (3): 8 tokens in 3 rounds
    mask[0, 4:] = 1
    ok[0, 0, [3, 7]] = True
    ok[1, 0, [3, 7]] = True
    ok[2, 0, 7] = True
    # row 1: nothing to learn; row 2: spans x_1..x_2 (t = 0 accepts 1) and x_6..x_8 (t = 5: 0, t = 6: 1)
    mask[2, 1:3] = 1
    mask[2, 6:9] = 1
    ok[0, 2, [0, 6]] = True
    ok[1, 2, 5] = True  # a later step is never reached past a rejected one
    assert walked_accept_len(ok, mask, k=3) == (8 + 5, 3 + 3, 2 + 2)
    # chains of one draft: row 0 rounds at t = 3 (1), 5 (0), 6 (0), 7 (1), 9 (0); row 2 as before
    assert walked_accept_len(ok, mask, k=1) == (7 + 5, 5 + 3, 2 + 2)
    real = torch.ones(3, 12, dtype=torch.long)
    real[0, 8:] = 0  # padding is never decoded: row 0's span ends at x_7, one round covers it
    assert walked_accept_len(ok, mask, real, k=3) == (3 + 5, 1 + 3, 1 + 2)


def test_per_step_weighting_and_reductions():
    head = _head(seed=1)
    inputs = _inputs(seed=3)
    base = ttt_loss(head, *inputs, steps=3)
    torch.testing.assert_close(base.loss.detach(), (base.per_step_loss * torch.tensor([1, 0.8, 0.64])).sum())
    only = ttt_loss(head, *inputs, steps=3, weights=[0.0, 1.0, 0.0])
    torch.testing.assert_close(only.loss.detach(), base.per_step_loss[1])
    half = ttt_loss(head, *inputs, steps=3, decay=0.5)
    torch.testing.assert_close(half.loss.detach(), (base.per_step_loss * torch.tensor([1, 0.5, 0.25])).sum())
    summed = ttt_loss(head, *inputs, steps=3, reduction="sum")
    torch.testing.assert_close(
        summed.loss.detach(), (base.per_step_loss * base.per_step_tokens * torch.tensor([1, 0.8, 0.64])).sum())
    with pytest.raises(ValueError):
        ttt_loss(head, *inputs, steps=3, weights=[1.0, 1.0])
    module = TTTModule(head, inputs[0], steps=3)
    assert set(module.state_dict()) == {f"head.{k}" for k in head.state_dict()}  # no embedding
    torch.testing.assert_close(module(*inputs[1:]).loss, base.loss, atol=0, rtol=0)


def test_compiled_head_parts_trace_once_and_agree():
    """``compile_head``: the parts around the attention are traced once for every step and shape."""
    graphs = []

    def backend(gm, example_inputs):  # counts what dynamo compiles, runs it as traced
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    head = _head(seed=2)
    for B, S, seed in ((3, 10, 0), (4, 17, 1)):
        inputs = _inputs(B=B, S=S, seed=seed)
        want = ttt_loss(head, *inputs, steps=4)
        want_grads = torch.autograd.grad(want.loss, list(head.parameters()))
        got = ttt_loss(head, *inputs, steps=4, compile_head=backend)
        got_grads = torch.autograd.grad(got.loss, list(head.parameters()))
        torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
        assert got.per_step_correct.tolist() == want.per_step_correct.tolist()
        for g_got, g_want in zip(got_grads, want_grads):
            torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=1e-5)
    assert len(graphs) == 2  # before_attention, after_attention


def test_simulated_acceptance_length():
    assert float(simulated_accept_len(torch.tensor([0.5, 0.5, 1.0]))) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert float(simulated_accept_len(torch.zeros(7))) == 1.0


@pytest.fixture(scope="module")
def tiny_target():
    return make_tiny("llama", seed=0, layers=4)


def _vocab_and_batches(target, n_batches, B=8, S=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(3, 96, (B, S), generator=g) for _ in range(n_batches)]
    vocab = build_draft_vocab(((b, torch.ones_like(b)) for b in batches), 96, 64)
    return vocab, batches


def test_gradients_reach_the_head_only(tiny_target):
    vocab, (ids,) = _vocab_and_batches(tiny_target, 1)
    cfg = Eagle3Config.for_target(tiny_target.config, vocab.draft_vocab_size, aux_layer_ids=(1, 2, 3))
    head = Eagle3Head(cfg)
    with TargetCapture(tiny_target, cfg.aux_layer_ids, vocab) as cap:
        cap_out = cap(ids)
    out = ttt_loss(head, tiny_target.get_input_embeddings(), cap_out.aux, ids, torch.ones_like(ids),
                   cap_out.teacher, steps=3)
    out.loss.backward()
    for name, p in head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None and not p.requires_grad for p in tiny_target.parameters())


def test_training_reduces_loss_and_raises_step0_accuracy(tiny_target):
    torch.manual_seed(0)
    vocab, batches = _vocab_and_batches(tiny_target, 5)
    cfg = Eagle3Config.for_target(tiny_target.config, vocab.draft_vocab_size, aux_layer_ids=(1, 2, 3))
    head = Eagle3Head(cfg)
    head.set_vocab(vocab.d2t, vocab.t2d)
    embed = tiny_target.get_input_embeddings()
    with TargetCapture(tiny_target, cfg.aux_layer_ids, vocab) as cap:
        data = [(ids, cap(ids)) for ids in batches]
    train, (eval_ids, eval_cap) = data[:-1], data[-1]

    def evaluate():
        with torch.no_grad():
            return ttt_loss(head, embed, eval_cap.aux, eval_ids, torch.ones_like(eval_ids), eval_cap.teacher, steps=3)

    before = evaluate()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: OpenMP barriers only cost time, badly so on a busy machine
    try:
        for it in range(200):
            ids, c = train[it % len(train)]
            out = ttt_loss(head, embed, c.aux, ids, torch.ones_like(ids), c.teacher, steps=3)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    after = evaluate()
    assert float(after.loss) < 0.8 * float(before.loss), (before.per_step_loss, after.per_step_loss)
    assert float(after.per_step_acc[0]) > float(before.per_step_acc[0]) + 0.2, (before.per_step_acc, after.per_step_acc)
    assert float(after.sim_accept_len) > float(before.sim_accept_len)
