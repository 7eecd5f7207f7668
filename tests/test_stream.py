"""Layer-streamed hidden states equal the stock model's forward, bit for bit in float32 on the CPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

from outrider.errors import UserError
from outrider.memory_plan import RESERVE
from outrider.train.states.stream import (
    Chunk,
    StreamedTarget,
    plan_chunks,
    plan_passes,
    text_config,
)

AUX = (0, 2, 3)  # 0: the embeddings, as Hugging Face numbers them


def examples(lengths, seed=0, vocab=90):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def reference(model, exs, chunk: Chunk, aux=AUX, pad_id=0):
    """The stock forward of one chunk, split per example: {example: (aux [len, n*H], final [len, H])}."""
    if chunk.packed:
        ids = torch.tensor([t for i in chunk.examples for t in exs[i]])[None]
        pos = torch.cat([torch.arange(n) for n in chunk.lengths])[None]
        hs = model(ids, position_ids=pos, use_cache=False, output_hidden_states=True).hidden_states
        spans, at = [], 0
        for n in chunk.lengths:
            spans.append((0, at, n))
            at += n
    else:
        ids = torch.full((chunk.rows, chunk.width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(chunk.examples):
            ids[r, : len(exs[i])] = torch.tensor(exs[i])
            mask[r, : len(exs[i])] = 1
        hs = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        spans = [(r, 0, n) for r, n in enumerate(chunk.lengths)]
    return {i: (torch.cat([hs[j][r, a: a + n] for j in aux], -1), hs[-1][r, a: a + n])
            for i, (r, a, n) in zip(chunk.examples, spans)}


def assert_streamed_equal(model, target: StreamedTarget, exs, aux=AUX):
    out = target.states(exs)
    lengths = [len(x) for x in exs]
    checked = 0
    for members in plan_passes(lengths, target.tokens_per_pass):
        chunks, _ = target.plan([lengths[i] for i in members])
        for chunk in chunks:
            ref = reference(model, [exs[i] for i in members], chunk, aux, target.pad_id)
            for local, (a, f) in ref.items():
                got_a, got_f = out[members[local]]
                assert got_a.shape == (lengths[members[local]], len(aux) * model.config.hidden_size)
                assert torch.equal(got_a, a) and torch.equal(got_f, f), (members[local], chunk)
                checked += 1
    assert checked == len(exs)
    return out


@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_streamed_equals_forward(tiny_dir, tiny_kind, packing):
    from transformers import AutoModelForCausalLM

    folder = tiny_dir(tiny_kind)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    exs = examples([9, 17, 4, 12, 17, 6, 1])
    with StreamedTarget(folder, AUX, device="cpu", packing=packing, tokens_per_pass=40, max_chunk_tokens=24) as st:
        assert_streamed_equal(model, st, exs)
        assert len(st.stats) == 2 and sum(s.tokens for s in st.stats) == sum(map(len, exs))
        assert max(s.chunks for s in st.stats) > 1  # several passes, several chunks each
        assert st.stats[0].nbytes > 0 and st.stats[0].compute_s > 0


def test_eager_attention_equals_forward(tiny_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_dir("deepseek_v3")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with StreamedTarget(folder, AUX, device="cpu", attn_implementation="eager") as st:
        assert_streamed_equal(model, st, examples([5, 11, 8], seed=1))


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    from int4_ckpt import save_int4_deepseek

    return save_int4_deepseek(tmp_path_factory.mktemp("int4"))


def library_dequantized(folder, dtype=torch.float32):
    """The target as transformers + compressed-tensors load it, experts dequantized by the library."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    # the library leaves the experts in the scales' dtype (bf16): lift them for a float32 reference (exact);
    # in bf16 the router stays float32 (transformers' _keep_in_fp32_modules_strict)
    return model.eval().float() if dtype == torch.float32 else model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_streamed_equals_library(int4_dir, dtype):
    config = json.loads((int4_dir / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    model = library_dequantized(int4_dir, dtype)
    with StreamedTarget(int4_dir, (1, 2), device="cpu", dtype=dtype) as st:
        assert st.int4 is not None and st.int4.group_size == 32
        assert_streamed_equal(model, st, examples([6, 14, 3, 9], seed=2), aux=(1, 2))


def test_kimi_layout_sharded_prefixed(int4_dir, tmp_path):
    """Kimi-K2.5's layout: a kimi_k25 wrapper config, language_model.-prefixed names, an index of shards."""
    from int4_ckpt import reshard

    kimi = reshard(int4_dir, tmp_path / "kimi", shards=3, prefix="language_model.", kimi_wrapper=True)
    exs = examples([5, 10, 7], seed=3)
    with StreamedTarget(int4_dir, (1, 2), device="cpu") as a, StreamedTarget(kimi, (1, 2), device="cpu") as b:
        assert b.prefix == "language_model.model."
        for (xa, fa), (xb, fb) in zip(a.states(exs), b.states(exs)):
            assert torch.equal(xa, xb) and torch.equal(fa, fb)
    # the text config alone (model_type kimi_k2, as some transformers versions hand it back) reads
    # as DeepSeek-V3 with its quantization config, whatever this transformers knows of kimi_k25
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(json.loads((kimi / "config.json").read_text())["text_config"]))
    config, quant = text_config(bare)
    assert config.model_type == "deepseek_v3" and quant["format"] == "pack-quantized"
    assert config.num_hidden_layers == text_config(int4_dir)[0].num_hidden_layers


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and text
    return text


def test_missing_and_truncated_shards(int4_dir, tmp_path):
    from int4_ckpt import reshard

    missing = reshard(int4_dir, tmp_path / "missing", shards=3)
    os.remove(missing / "model-00002-of-00003.safetensors")
    with pytest.raises(UserError) as e:
        StreamedTarget(missing, device="cpu")
    assert "model-00002-of-00003.safetensors is missing" in one_line(e)

    cut = reshard(int4_dir, tmp_path / "cut", shards=3)
    shard = cut / "model-00003-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(UserError) as e:
        StreamedTarget(cut, device="cpu")
    assert "truncated" in one_line(e)


def test_budget_smaller_than_a_layer(tiny_dir):
    with pytest.raises(UserError) as e:
        StreamedTarget(tiny_dir("deepseek_v3"), device="cpu", gpu_memory=0.0001)
    assert "too small for layer streaming: a chunk of 1 token(s) needs" in one_line(e)


def test_budget_splits_chunks(tiny_dir):
    """A budget just above one layer's need runs the pass in more, smaller chunks, with the same states."""
    from transformers import AutoModelForCausalLM

    folder = tiny_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    exs = examples([12, 9, 7, 5])
    with StreamedTarget(folder, AUX, device="cpu") as free:
        assert len(free.plan([len(x) for x in exs])[0]) == 1
        m = free.memory
        need = m.peak(38, 24, 12, True) / (1 - RESERVE)  # the states of (12, 9) and (7, 5) padded, the first chunk
    with StreamedTarget(folder, AUX, device="cpu", gpu_memory=need / 1e9) as tight:
        chunks, _ = tight.plan([len(x) for x in exs])
        assert len(chunks) > 1
        assert_streamed_equal(model, tight, exs)


def test_bad_inputs(tiny_dir, tmp_path):
    folder = tiny_dir("llama")
    with StreamedTarget(folder, device="cpu") as st:
        with pytest.raises(UserError) as e:
            st.states([[1, 2, 500]])
        assert "outside the target's vocabulary" in one_line(e)
        with pytest.raises(UserError):
            st.states([[]])
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    for name in os.listdir(folder):
        (fp8 / name).write_bytes((folder / name).read_bytes())
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        StreamedTarget(fp8, device="cpu")
    assert "fp8" in one_line(e)


def test_plan_passes_and_chunks():
    assert plan_passes([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    chunks = plan_chunks([3, 8, 5, 8, 1], packed=False, max_tokens=16)
    assert [c.examples for c in chunks] == [(1, 3), (2, 0, 4)]  # longest first, stable, padded to the first
    assert [c.padded_tokens for c in chunks] == [16, 15]
    packed = plan_chunks([3, 8, 5, 8, 1], packed=True, max_tokens=16)
    assert [c.examples for c in packed] == [(1, 3), (2, 0, 4)] and packed[1].width == 9 and packed[1].rows == 1
    tight = plan_chunks([4, 4, 4], packed=False, max_tokens=100, fits=lambda c: c.padded_tokens * (10 + c.width) <= 112)
    assert [c.examples for c in tight] == [(0, 1), (2,)]


def test_cache_parameter_follows_the_transformers_release():
    """The streamed layers and the verdict pass the cache under the name this release takes
    (``cache`` in recent 5.x, ``past_key_values`` in 5.17, which the lent GPU machines run)."""
    from outrider.models import cache_parameter

    def recent(inputs_embeds, cache=None):
        return cache

    def older(inputs_embeds, past_key_values=None):
        return past_key_values

    assert cache_parameter(recent) == "cache" and cache_parameter(older) == "past_key_values"
