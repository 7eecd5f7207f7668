"""The streamed capture's memory plan holds: the working set is measured, the analytic model bounds it,
and a budget between a layer's weights and the weights plus a chunk's working set is chunked or refused
before anything loads, never run past the budget.

"Measured" is ``outrider.train.states.workset.LiveBytes``: bytes of the tensors ops return, alive at once
(the CPU has no memory limit to hit; the count is what the budget is held against).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from outrider.errors import UserError
from outrider.memory_plan import RESERVE, StreamMemory, analytic_working_set
from outrider.models import arch_info
from outrider.train.states.stream import StreamedTarget, build_skeleton, layer_step
from outrider.train.states.workset import LiveBytes, measure_decoder, measure_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from test_stream import assert_streamed_equal, examples  # noqa: E402

LENGTHS = [40, 36, 30, 24, 20, 12]  # one pass; padded: rows of 40, 36, ...


def kimi_config(layers: int = 2):
    from stream_bench import SHAPES
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**SHAPES["kimi"], num_hidden_layers=layers)


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float32), ("deepseek_v3", torch.float32),
                                        ("deepseek_v3", torch.bfloat16), ("kimi", torch.bfloat16)])
def test_analytic_working_set_bounds_the_measured_one(kind, dtype):
    """At Kimi-K2.5's widths too (the meta device needs no memory): the analytic model (``plan``'s) is
    above the measured one (the streamer's) in every phase and at most 1.5x it for the MoE dispatch."""
    from tiny import tiny_config

    config = kimi_config() if kind == "kimi" else tiny_config(kind)
    model = build_skeleton(config, dtype)
    measured = measure_decoder(config, model.get_decoder(), dtype, layer_step)
    analytic = analytic_working_set(arch_info(config), torch.empty((), dtype=dtype).element_size())
    for rows, width in [(1, 128), (4, 512), (2, 2048), (16, 1024)]:
        tokens = rows * width
        for name, p in measured.phases.items():
            a = analytic.phases[name].bytes(tokens, width)
            assert p.bytes(tokens, width) <= a, (name, rows, width)
        assert analytic.bytes(tokens, width) <= 1.6 * measured.bytes(tokens, width)
    if kind == "kimi":  # the MoE dispatch of 32,768 tokens: ~23.6 GB, nearly all of it per routed pair
        mlp = measured.phases["mlp"].bytes(32768, 1024)
        assert 20e9 < mlp <= analytic.phases["mlp"].bytes(32768, 1024) <= 1.05 * mlp


@torch.no_grad()
def test_real_layer_stays_within_its_measured_working_set(tiny_dir):
    """The tiny DeepSeek-V3's MoE layer with real weights on the CPU allocates no more than its meta
    measurement says, and its MoE dispatch as much (the same ops; the CPU's attention kernel is fused)."""
    folder = tiny_dir("deepseek_v3")
    with StreamedTarget(folder, device="cpu") as st:
        stream = st.loader.stream(st.units[:3])
        for _ in range(2):
            next(stream).release()
        loaded = next(stream)  # decoder layer 1: MoE
        loaded.materialise(st.temp_bytes)
        layer = loaded.unit.module
        from transformers.masking_utils import create_causal_mask

        from outrider.models import cache_parameter
        for width in (64, 160):
            h = torch.randn(1, width, st.hidden_size)  # [1, width, H]
            pad = torch.ones(1, width, dtype=torch.long)
            pad[0, -1] = 0

            def step(module, x, w):
                mask = create_causal_mask(config=st.config, inputs_embeds=x, attention_mask=pad,
                                          position_ids=torch.arange(w)[None],
                                          **{cache_parameter(create_causal_mask): None})
                return layer_step(module, x, mask, torch.arange(w)[None], st.rotary, st.norm)

            real = measure_step(step, layer, h, width, exclude=[*st.rotary.buffers(), *st.norm.parameters()])
            for name, peak in real.items():
                assert peak <= st.working.phases[name].bytes(width, width) * 1.02, (name, width)
            assert real["mlp"] >= 0.9 * st.working.phases["mlp"].bytes(width, width)
        loaded.release()
        stream.close()


def run_peak(st: StreamedTarget, exs) -> tuple[list, int]:
    """States and the peak device bytes of ``st.states(exs)``: the tensors the pass allocates (weights
    built, states, inputs, working set) counted live, plus the loader's two staging buffers."""
    meter = LiveBytes(st.device, exclude=st.loader.slots)
    with meter:
        out = st.states(exs)
    return out, meter.peak + sum(s.numel() for s in st.loader.slots)


def test_budget_between_weights_and_working_set_is_chunked(tiny_dir):
    """A budget that holds the weights and the pass's states but not the working set of the whole pass
    in one chunk: the plan cuts the pass into chunks that fit, the run's measured peak stays under the
    budget (one chunk would have gone over it), and the states are the stock model's."""
    from transformers import AutoModelForCausalLM

    folder = tiny_dir("deepseek_v3")
    exs = examples(LENGTHS, seed=4)
    padded = len(LENGTHS) * max(LENGTHS)
    with StreamedTarget(folder, (0, 2, 3), device="cpu") as free:
        m: StreamMemory = free.memory
        assert len(free.plan(LENGTHS)[0]) == 1
        _, one_chunk_peak = run_peak(free, exs)
        weights_only = m.peak(padded, 0, 1, True) - m.working.bytes(0, 1)
        whole = m.peak(padded, padded, max(LENGTHS), True)
    assert one_chunk_peak <= whole  # the plan prices the unchunked run at or above what it allocates
    budget = (weights_only + 0.4 * (whole - weights_only)) / (1 - RESERVE)
    assert one_chunk_peak > budget  # run in one chunk, this pass would go over the budget
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with StreamedTarget(folder, (0, 2, 3), device="cpu", gpu_memory=budget / 1e9) as tight:
        chunks, where = tight.plan(LENGTHS)
        assert where == "device" and len(chunks) > 1
        assert tight._peak(chunks, where) <= tight.memory.usable
        out, peak = run_peak(tight, exs)
        assert peak <= budget * (1 - RESERVE), (peak, budget)
        assert tight.stats[-1].planned_bytes >= peak
        assert_streamed_equal(model, tight, exs, aux=(0, 2, 3))


def test_budget_below_the_longest_example_is_refused_before_loading(tiny_dir, monkeypatch):
    folder = tiny_dir("deepseek_v3")
    with StreamedTarget(folder, device="cpu") as free:
        m = free.memory
        short, long_ = m.peak(168, 8, 8, True), m.peak(160, 160, 160, False)  # pass of 8 + 160 tokens
        assert short < long_
        budget = (short + long_) / 2 / (1 - RESERVE)  # chunks of the 8-token example fit, the 160 one does not
    with StreamedTarget(folder, device="cpu", gpu_memory=budget / 1e9) as st:
        reads = []
        monkeypatch.setattr(st.loader, "_load", lambda *a: reads.append(a))
        with pytest.raises(UserError) as e:
            st.states(examples([8, 160]))
        text = str(e.value)
        assert "\n" not in text and "too small for layer streaming: a chunk of 160 token(s) needs" in text
        assert not reads and not st.stats  # refused before a byte was read
        monkeypatch.undo()
        st.states(examples([8, 6]))  # what fits still runs
        assert st.stats[-1].tokens == 14
