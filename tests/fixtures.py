"""Config-only model folders shaped like real ones, written to a directory on demand.

Sizes and field names follow the published configs (Kimi-K2.5's ``kimi_k25`` wrapper with its
``text_config``, Kimi-K2-Instruct, DeepSeek-V3 with one MTP layer, and an EAGLE-3 head shaped
like the published Kimi-K2 heads trained with SpecForge); no weights. The Kimi folders carry a
tiny stand-in ``tiktoken.model`` (the 256 byte tokens and a few merges) and no ``tokenizer.json``,
as the real ones do. ``overrides`` patch a config (``None`` deletes a key) to build broken variants.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

KIMI_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
_KIMI_SPECIALS = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
                  163588: "<|im_assistant|>", 163594: "<|im_system|>", 163601: "<|im_middle|>"}


def _patch(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(config)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def _write(path: str | Path, config: dict[str, Any], files: dict[str, str] | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


def kimi_tokenizer_files(merges: tuple[bytes, ...] = (b"th", b"he", b"the", b"in", b"er")) -> dict[str, str]:
    ranks = [bytes([i]) for i in range(256)] + list(merges)
    model = "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(ranks))
    tokenizer_config = {
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "pad_token": "[EOS]", "unk_token": "[EOS]", "chat_template": KIMI_CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in _KIMI_SPECIALS.items()},
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    return {"tiktoken.model": model, "tokenizer_config.json": json.dumps(tokenizer_config, indent=2)}


def _kimi_text_config(**overrides: Any) -> dict[str, Any]:
    return _patch({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "bos_token_id": 163584, "eos_token_id": 163585, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }, overrides)


def kimi_k25(path: str | Path, **overrides: Any) -> Path:
    """Kimi-K2.5: the ``kimi_k25`` multimodal wrapper, INT4 (compressed-tensors) text model."""
    text = _kimi_text_config(quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 32,
                                                  "symmetric": True, "strategy": "group"}}},
    })
    config = _patch({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "text_config": text, "vision_config": {"model_type": "moonvit", "hidden_size": 1152},
        "media_placeholder_token_id": 163605, "torch_dtype": "bfloat16",
    }, overrides)
    return _write(path, config, kimi_tokenizer_files())


def kimi_k2(path: str | Path, **overrides: Any) -> Path:
    """Kimi-K2-Instruct: DeepSeek-V3 architecture, block FP8, 128k positions."""
    config = _kimi_text_config(
        max_position_embeddings=131072,
        rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128]},
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    return _write(path, _patch(config, overrides), kimi_tokenizer_files())


def deepseek_v3(path: str | Path, **overrides: Any) -> Path:
    """DeepSeek-V3: 61 layers, 256 experts, one MTP layer (``num_nextn_predict_layers``)."""
    config = _patch({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "num_nextn_predict_layers": 1,
        "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    }, overrides)
    return _write(path, config)


def kimi_k2_eagle3_head(path: str | Path, readme: bool = True, **overrides: Any) -> Path:
    """An EAGLE-3 head shaped like the published Kimi-K2 ones (SpecForge ``LlamaForCausalLMEagle3``)."""
    config = _patch({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 163584, "eos_token_id": 163585,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
        "intermediate_size": 18432, "max_position_embeddings": 131072, "num_attention_heads": 64,
        "num_hidden_layers": 1, "num_key_value_heads": 64, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 163840, "draft_vocab_size": 32000,
    }, overrides)
    files = {"README.md": "---\nlicense: mit\nbase_model: moonshotai/Kimi-K2-Instruct\n---\n# Kimi-K2 EAGLE-3\n"} \
        if readme else {}
    return _write(path, config, files)


def kimi_k25_eagle3_mla_head(path: str | Path, **overrides: Any) -> Path:
    """An EAGLE-3 MLA head shaped like the published Kimi-K2.5 ones (``Eagle3DeepseekV2ForCausalLM``): the
    target's MLA sizes and YaRN, ids written for SGLang in eagle_config and for vLLM at the top level."""
    config = _patch({
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
        "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "vocab_size": 163840, "draft_vocab_size": 163840, "rope_theta": 50000.0, "max_position_embeddings": 262144,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [2, 30, 58], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }, overrides)
    return _write(path, config, {"README.md": "---\nbase_model: moonshotai/Kimi-K2.5\n---\n# Kimi-K2.5 EAGLE-3 MLA\n"})
