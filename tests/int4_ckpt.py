"""Checkpoints laid out as real large targets ship: INT4 experts quantized by compressed-tensors, shards, prefixes.

``save_int4_deepseek(path)``: the tiny DeepSeek-V3 of ``tiny.py`` in bf16 whose routed experts are
pack-quantized INT4, group 32, symmetric, min-max scales, written by the ``compressed-tensors``
library itself (Kimi-K2.5's scheme and ignore list). ``reshard(src, dst, ...)``: the same tensors
split into several shards with a ``model.safetensors.index.json``, optionally renamed under a
prefix (Kimi-K2.5's ``language_model.``) and wrapped in a ``kimi_k25`` config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny import make_tiny, tiny_tokenizer
from torch import nn

KIMI_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*"]


class _Expert(nn.Module):
    """One routed expert as checkpoints name it: experts.{e}.{gate,up,down}_proj."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_proj = nn.Linear(gate.shape[1], gate.shape[0], bias=False, dtype=gate.dtype)
        self.up_proj = nn.Linear(up.shape[1], up.shape[0], bias=False, dtype=up.dtype)
        self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False, dtype=down.dtype)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate)
            self.up_proj.weight.copy_(up)
            self.down_proj.weight.copy_(down)


def _unfuse_experts(model: nn.Module) -> None:
    """transformers 5 fuses experts into 3-D parameters; compressed-tensors quantizes nn.Linear only."""
    for layer in model.model.layers:
        ex = getattr(layer.mlp, "experts", None)
        if ex is None:
            continue
        inter = ex.intermediate_dim
        layer.mlp.experts = nn.ModuleList(
            _Expert(ex.gate_up_proj.data[e, :inter], ex.gate_up_proj.data[e, inter:], ex.down_proj.data[e])
            for e in range(ex.num_experts))


def save_int4_deepseek(path: str | Path, seed: int = 0, layers: int = 3) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors.torch import save_file

    path = Path(path)
    model = make_tiny("deepseek_v3", seed, layers=layers)
    with torch.no_grad():  # wider weights than the default init, so that rounding to INT4 matters
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3)
        for layer in model.model.layers[model.config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model = model.to(torch.bfloat16)
    for layer in model.model.layers[model.config.first_k_dense_replace:]:  # DeepSeek and Kimi ship it in F32
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    _unfuse_experts(model)
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32,
                               observer="minmax", dynamic=False)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                ignore=KIMI_IGNORE, format="pack-quantized",
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    quantized = 0
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        assert ".mlp.experts." in name, name
        scale, zero = compute_dynamic_scales_and_zp(module.weight.data, module.quantization_scheme.weights, module)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)
        quantized += 1
    cfg = model.config
    assert quantized == 3 * cfg.n_routed_experts * (cfg.num_hidden_layers - cfg.first_k_dense_replace)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.quantization_config.ignore = list(KIMI_IGNORE)
    compressor.compress_model(model)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(path)
    compressor.update_config(str(path))
    tiny_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path


def reshard(src: str | Path, dst: str | Path, shards: int = 3, prefix: str = "", kimi_wrapper: bool = False) -> Path:
    """``src``'s tensors in ``shards`` files with an index, names under ``prefix``; with
    ``kimi_wrapper`` the config becomes a ``kimi_k25`` wrapper whose ``text_config`` (``kimi_k2``)
    holds the quantization config, as Kimi-K2.5 ships it."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = {prefix + n: tensors[n] for n in names[s::shards]}
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    if kimi_wrapper:
        text = dict(config, model_type="kimi_k2")
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "text_config": text, "vision_config": {"model_type": "moonvit"}, "torch_dtype": "bfloat16"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
