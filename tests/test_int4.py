"""compressed-tensors pack-quantized INT4: our unpacking equals the library's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from outrider.errors import UserError
from outrider.train.states.int4 import Int4Scheme, dequant_int4, unpack_int4, unpack_int4_rows

KIMI_QUANT = {  # Kimi-K2.5's text_config.quantization_config
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                              "group_size": 32, "num_bits": 4, "observer": "minmax",
                                              "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                              "type": "int"}}},
    "format": "pack-quantized", "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def test_scheme_from_config():
    assert Int4Scheme.from_config(None) is None
    assert Int4Scheme.from_config(KIMI_QUANT) == Int4Scheme(group_size=32, symmetric=True)
    with pytest.raises(UserError, match="quantized with 'fp8'"):
        Int4Scheme.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    eight = {**KIMI_QUANT, "config_groups": {"group_0": {"weights": {
        **KIMI_QUANT["config_groups"]["group_0"]["weights"], "num_bits": 8}}}}
    with pytest.raises(UserError, match="8-bit int"):
        Int4Scheme.from_config(eight)
    with pytest.raises(UserError, match="float-quantized"):
        Int4Scheme.from_config({**KIMI_QUANT, "format": "float-quantized"})


def test_unpack_literal():
    # element j of a row sits in word j // 8 at bits 4*(j % 8); nibble = q + 8
    q = torch.tensor([[-8, -1, 0, 7, 3, -3, 1, 2]])
    word = sum(int(v + 8) << (4 * j) for j, v in enumerate(q[0].tolist()))
    packed = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    assert torch.equal(unpack_int4(packed, 8), q.to(torch.int8))
    assert torch.equal(unpack_int4_rows(packed.t().contiguous(), 8), q.t().to(torch.int8))
    scale = torch.tensor([[0.5]], dtype=torch.bfloat16)
    assert torch.equal(dequant_int4(packed, scale, 8, dtype=torch.float32), q.float() * 0.5)


def test_unpack_matches_library():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    g = torch.Generator().manual_seed(0)
    for symmetric in (True, False):
        args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=32)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        for rows, cols in [(64, 32), (96, 256), (7, 64), (40, 448)]:
            if not symmetric and rows < 8:  # the library cannot unpack its own zero points below 8 rows
                continue
            for dtype in (torch.bfloat16, torch.float32, torch.float16):
                w = (torch.randn(rows, cols, generator=g) * 0.3).to(dtype)
                scale, zero = compute_dynamic_scales_and_zp(w, args, None)
                sd = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
                assert sd["weight_packed"].shape == (rows, cols // 8) and sd["weight_scale"].dtype == dtype
                assert torch.equal(unpack_int4(sd["weight_packed"], cols),
                                   unpack_from_int32(sd["weight_packed"], 4, sd["weight_shape"]))
                zp = None if symmetric else unpack_int4_rows(sd["weight_zero_point"], rows)
                ours = dequant_int4(sd["weight_packed"], sd["weight_scale"], cols, zp)
                assert torch.equal(ours, compressor.decompress(sd, scheme)["weight"]), (symmetric, rows, cols, dtype)
                # the product is taken in the scale's dtype: not the same as in float32 for bf16
                if dtype == torch.bfloat16:
                    wide = dequant_int4(sd["weight_packed"], sd["weight_scale"].float(), cols,
                                        None if zp is None else zp)
                    assert not torch.equal(ours.float(), wide)


def test_experts_equal_library_dequantizer(tmp_path):
    """The fused experts we build from the checkpoint equal compressed-tensors' own dequantizer."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from int4_ckpt import save_int4_deepseek
    from safetensors.torch import load_file

    from outrider.train.states.stream import build_skeleton, text_config
    from outrider.train.states.weights import SafetensorsFiles, build_tensor, module_recipes

    folder = save_int4_deepseek(tmp_path / "int4", layers=2)
    raw = load_file(str(folder / "model.safetensors"))
    assert not any(k.endswith("experts.0.gate_proj.weight") for k in raw)  # stored quantized only
    library = CompressedTensorsDequantizer(str(folder), dtype=torch.float32).process(dict(raw))
    config, quant = text_config(folder)
    layer = build_skeleton(config, torch.float32).model.layers[1]
    files = SafetensorsFiles(folder)
    recipes = {r.key: r for r in module_recipes(files, layer, "model.layers.1", "model.layers.1.")}
    assert recipes["mlp.experts.gate_up_proj"].kind == "experts" and recipes["mlp.shared_experts.up_proj.weight"].kind == "plain"
    gate_up = build_tensor(recipes["mlp.experts.gate_up_proj"], files.tensor, temp_bytes=3000)  # [E, 2I, H], in groups
    down = build_tensor(recipes["mlp.experts.down_proj"], files.tensor)  # [E, H, I]
    inter = config.moe_intermediate_size
    for e in range(config.n_routed_experts):
        p = f"model.layers.1.mlp.experts.{e}."
        assert torch.equal(gate_up[e, :inter], library[p + "gate_proj.weight"])
        assert torch.equal(gate_up[e, inter:], library[p + "up_proj.weight"])
        assert torch.equal(down[e], library[p + "down_proj.weight"])
