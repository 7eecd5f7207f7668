"""Targets the planner knows by name, from their published configs, and target resolution.

Contract: ``PRESETS`` maps a name to (display name, ``ArchInfo``, weight precision spec);
``resolve_target(t)`` gives the same triple for a preset name or a model / config-only folder
(precision None: ``hardware.default_precision`` reads it from the config). The configs are the
fields of each model's ``config.json`` the cost model reads; nothing is downloaded.

Not done here: costs (``cost_model``), plans (``planner``, ``train_plan``)."""

from __future__ import annotations

from pathlib import Path

from outrider.models import ArchInfo, arch_info, load_config_dict

KIMI_K25 = ArchInfo(
    model_type="kimi_k2", architectures=("DeepseekV3ForCausalLM",), num_layers=61, hidden_size=7168,
    vocab_size=163840, num_heads=64, num_kv_heads=64, head_dim=192, attention="MLA", intermediate_size=18432,
    max_position_embeddings=262144, tie_word_embeddings=False, num_experts=384, experts_per_token=8,
    num_shared_experts=1, moe_intermediate_size=2048, first_dense_layers=1, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_mtp_layers=0, dtype="bfloat16",
    quantization="compressed-tensors-int4",
)
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): the same MLA shapes with 128 heads, 256 routed
# experts, 3 dense layers first, one MTP (NextN) layer, FP8 weights in 128 x 128 blocks.
DEEPSEEK_V3 = ArchInfo(
    model_type="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), num_layers=61, hidden_size=7168,
    vocab_size=129280, num_heads=128, num_kv_heads=128, head_dim=192, attention="MLA", intermediate_size=18432,
    max_position_embeddings=163840, tie_word_embeddings=False, num_experts=256, experts_per_token=8,
    num_shared_experts=1, moe_intermediate_size=2048, first_dense_layers=3, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_mtp_layers=1, dtype="bfloat16",
    quantization="fp8",
)
# gpt-oss-120b (openai/gpt-oss-120b config.json): 36 layers, 128 experts, 4 per token, GQA 64/8 heads
# of 64, MXFP4 experts; its sliding-window layers are modelled as full attention (short contexts).
GPT_OSS_120B = ArchInfo(
    model_type="gpt_oss", architectures=("GptOssForCausalLM",), num_layers=36, hidden_size=2880, vocab_size=201088,
    num_heads=64, num_kv_heads=8, head_dim=64, attention="GQA", intermediate_size=2880,
    max_position_embeddings=131072, tie_word_embeddings=False, num_experts=128, experts_per_token=4,
    moe_intermediate_size=2880, dtype="bfloat16", quantization="mxfp4",
)
SMOLLM2_135M = ArchInfo(
    model_type="llama", architectures=("LlamaForCausalLM",), num_layers=30, hidden_size=576, vocab_size=49152,
    num_heads=9, num_kv_heads=3, head_dim=64, attention="GQA", intermediate_size=1536,
    max_position_embeddings=8192, tie_word_embeddings=True, dtype="bfloat16",
)
# Kimi-K2.5 ships INT4 (group 32, bf16 scales) routed experts; everything else is bf16.
PRESETS: dict[str, tuple[str, ArchInfo, str]] = {
    "kimi-k2.5": ("Kimi-K2.5", KIMI_K25, "int4-g32/bf16"),
    "deepseek-v3": ("DeepSeek-V3", DEEPSEEK_V3, "fp8"),
    "gpt-oss-120b": ("gpt-oss-120b", GPT_OSS_120B, "mxfp4/bf16"),
    "default": ("SmolLM2-135M", SMOLLM2_135M, "bf16"),
}


def resolve_target(target: str) -> tuple[str, ArchInfo, str | None]:
    """(display name, ArchInfo, preset precision or None) for a preset name or a model folder."""
    key = str(target).strip().lower()
    if key in PRESETS:
        name, arch, prec = PRESETS[key]
        return name, arch, prec
    arch = arch_info(load_config_dict(target))
    return Path(str(target)).name or str(target), arch, None
