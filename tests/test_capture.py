"""Capture: aux states equal HF output_hidden_states[j]; the teacher equals the full logits on the draft ids."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tiny

from outrider.train.states.capture import TargetCapture, capture

AUX = (0, 2, 4)  # 0 = the embeddings, 4 = the input of the last of 5 layers
DRAFT_IDS = torch.tensor([3, 5, 8, 17, 40, 41, 77, 90, 95])


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def target(request):
    return make_tiny(request.param, layers=5)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # right padding
    mask[2, :4] = 0  # left padding
    ids[mask == 0] = 0
    return ids, mask


def test_aux_and_teacher_match_hf(target):
    ids, mask = _batch()
    lm_calls = []
    handle = target.lm_head.register_forward_hook(lambda *a: lm_calls.append(1))
    try:
        got = capture(target, ids, mask, AUX, DRAFT_IDS)
    finally:
        handle.remove()
    assert not lm_calls  # full-vocabulary logits were never computed
    assert got.aux.shape == (3, 14, 3 * 64) and got.teacher.shape == (3, 14, len(DRAFT_IDS))
    assert not got.aux.requires_grad and not got.teacher.requires_grad
    for row in range(3):  # each row alone, unpadded: the reference for its real positions
        real = mask[row].bool()
        with torch.no_grad():
            ref = target(input_ids=ids[row, real][None], output_hidden_states=True)
        want_aux = torch.cat([ref.hidden_states[j] for j in AUX], dim=-1)[0]
        torch.testing.assert_close(got.aux[row, real], want_aux, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.teacher[row, real], ref.logits[0][:, DRAFT_IDS], atol=1e-4, rtol=1e-5)


def test_bound_capture_is_reusable_and_detaches(target):
    ids, mask = _batch()
    layers = target.model.layers
    with TargetCapture(target, AUX, DRAFT_IDS) as cap:
        assert cap.aux_layer_ids == AUX
        first = cap(ids, mask)
        second = cap(ids[:1], mask[:1])
        torch.testing.assert_close(first.aux[:1], second.aux, atol=1e-5, rtol=1e-5)  # MoE: batch-size rounding
        torch.testing.assert_close(first.teacher[:1], second.teacher, atol=1e-4, rtol=1e-5)
        assert not cap.aux_capture.states  # no hidden states kept between calls
    assert all(not layer._forward_pre_hooks for layer in layers)


def test_the_graphed_forward_with_its_explicit_mask_writes_what_the_capture_returns(target):
    """``write_into`` is the body a CUDA graph records (4-D mask, outputs into given buffers):
    run eagerly here, its values at real positions equal the plain capture's, padding either side."""
    ids, mask = _batch()
    with TargetCapture(target, AUX, DRAFT_IDS) as cap:
        want = cap(ids, mask)
        aux = torch.full_like(want.aux, float("nan"))
        teacher = torch.full_like(want.teacher, float("nan"))
        cap.write_into(ids, mask, aux, teacher)
        assert not cap.aux_capture.states
    real = mask.bool()
    assert torch.isfinite(aux).all() and torch.isfinite(teacher).all()  # every row saw at least itself
    torch.testing.assert_close(aux[real], want.aux[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(teacher[real], want.teacher[real], atol=1e-4, rtol=1e-5)


def test_graphs_are_off_on_the_cpu_and_without_a_token_budget(target):
    with TargetCapture(target, AUX, DRAFT_IDS, graphs=True, max_tokens=1000) as cap:
        assert not cap.graphs  # CUDA only
        ids, mask = _batch()
        got = cap(ids, mask)
        assert got.teacher.shape == (3, 14, len(DRAFT_IDS))


class _Rerun:
    """Stands in for a CUDA graph on the CPU: a replay runs the recorded body again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def test_graph_bookkeeping_per_shape_with_buffers_shared_across_shapes(target, monkeypatch):
    """The graphed path's inputs, outputs and per-shape entries, with the capture replaced by a
    re-run of the same body (the CUDA capture itself is tested on the GPU)."""
    import outrider.train.states.capture as capture_mod

    captured = []

    def fake_capture(fn, device, warmups, pool=None, after_each=None):
        captured.append(device)
        fn()
        return _Rerun(fn), None

    monkeypatch.setattr(capture_mod, "capture_graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    g = torch.Generator().manual_seed(1)
    with TargetCapture(target, AUX, DRAFT_IDS) as eager, \
            TargetCapture(target, AUX, DRAFT_IDS, graphs=True, max_tokens=3 * 14) as graphed:
        graphed.graphs = True  # as on CUDA
        for B, S in [(3, 14), (2, 9), (3, 14), (2, 30)]:  # the last one is over max_tokens: eager
            ids = torch.randint(3, 96, (B, S), generator=g)
            mask = torch.ones_like(ids)
            mask[0, S - 3:] = 0
            want, got = eager(ids, mask), graphed(ids, mask)
            real = mask.bool()
            torch.testing.assert_close(got.aux[real], want.aux[real], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.teacher[real], want.teacher[real], atol=1e-4, rtol=1e-5)
        assert sorted(graphed._graphs) == [(2, 9), (3, 14)] and len(captured) == 2
        a = graphed(torch.randint(3, 96, (2, 9), generator=g), torch.ones(2, 9, dtype=torch.long))
        b = graphed(torch.randint(3, 96, (3, 14), generator=g), torch.ones(3, 14, dtype=torch.long))
        assert a.teacher.data_ptr() == b.teacher.data_ptr()  # one persistent buffer: valid until the next call


def test_a_failed_graph_capture_falls_back_to_eager_with_a_note(target, monkeypatch):
    import outrider.train.states.capture as capture_mod

    def failing(fn, device, warmups, pool=None, after_each=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(capture_mod, "capture_graph", failing)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    ids, mask = _batch()
    with TargetCapture(target, AUX, DRAFT_IDS) as eager, \
            TargetCapture(target, AUX, DRAFT_IDS, graphs=True, max_tokens=100) as graphed:
        graphed.graphs = True
        got, want = graphed(ids, mask), eager(ids, mask)
        assert not graphed.graphs and "capture failed" in graphed.notes[0]
        torch.testing.assert_close(got.teacher, want.teacher)


def test_only_dense_full_attention_targets_are_graphed():
    from transformers import AutoModelForCausalLM, MistralConfig

    from outrider.train.states.capture import graphable

    assert graphable(make_tiny("llama")) and not graphable(make_tiny("deepseek_v3"))  # MoE: routed by data
    windowed = AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8))
    assert not graphable(windowed)  # one explicit full-context mask would ignore the window
