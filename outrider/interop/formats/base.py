"""What an export format is: the object each format file defines and ``formats`` registers.

Contract: a ``HeadFormat`` holds one format's tensor layout (``layer_prefix``, ``tensor_names``),
its config.json writer (``config``), its aux-id rule (``written_ids``, ``check_ids``), its lines in
LAUNCH.md (``vllm_notes``, ``sglang_refusal``) and how its folders are recognised when read
(``recognises``, ``read_layer``). The defaults are the EAGLE-3 draft config that SGLang and vLLM
both read (``LlamaForCausalLMEagle3`` with ``midlayer.*`` tensors, ``Eagle3DeepseekV2ForCausalLM``
with ``layers.0.*`` for MLA heads; EAGLE 3.1 options under the keys the engines read, a sliding
window as ``sliding_window`` + ``layer_types``); a format overrides what it does differently.

Not done here: writing files (``formats.export``), loading weights (``checkpoint``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from outrider.interop.engines import DRAFT_ARCH, MLA_DRAFT_ARCH, MLA_DRAFT_ARCHS, MLA_DRAFT_MODEL_TYPE

if TYPE_CHECKING:  # the registry is read by ``outrider --help``: no torch import at load
    import torch

    from outrider.heads.eagle3 import Eagle3Config

OUR_LAYER = "midlayer."
LAYERS0 = "layers.0."
EAGLE3_ARCHS = (DRAFT_ARCH, "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle") + MLA_DRAFT_ARCHS

AuxIds = tuple[tuple[int, ...], tuple[int, ...] | None, str]  # (top level: vLLM, eagle_config: SGLang, note)


def rename(name: str, src: str, dst: str) -> str:
    return dst + name[len(src):] if name.startswith(src) else name


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HeadFormat:
    """One export format; subclasses set ``name`` and override what differs from the EAGLE-3 default."""

    name = ""
    engine = "vllm"  # the engine this format is written for (its LAUNCH.md covers both where they load it)
    source = "eagle3"  # ``HeadSpec.source`` of a foreign folder in this format
    holds_mla = True  # MLA heads can be written (and read) in this format
    carries_target = False  # names its verifier and carries the target's embedding
    vllm_notes: tuple[str, ...] = ()  # extra LAUNCH.md lines under vLLM
    sglang_refusal: str | None = None  # LAUNCH.md's SGLang section when SGLang cannot load the format
    mask_hidden_dims = 2  # P-EAGLE's mask_hidden as [1, n_aux * H_t] (vLLM); speculators keeps [1, 1, n_aux * H]

    # tensor layout

    def layer_prefix(self, attention: str) -> str:
        """The decoder layer's name prefix: ``layers.0.`` for MLA drafts (the published MLA
        checkpoints' names; SGLang and vLLM read both), ``midlayer.`` otherwise."""
        return LAYERS0 if attention == "mla" else OUR_LAYER

    def tensor_names(self, cfg: Eagle3Config, ours: Iterable[str]) -> set[str]:
        """The exact tensor names a checkpoint of this format holds, from our names ``ours``."""
        prefix = self.layer_prefix(cfg.attention)
        return {rename(n, OUR_LAYER, prefix) for n in ours}

    # aux ids

    def written_ids(self, ids: tuple[int, ...], model_type: str | None) -> AuxIds:
        raise NotImplementedError

    def check_ids(self, ids: tuple[int, ...], num_layers: int | None) -> None:
        """``UserError`` when the format cannot hold these ids on a target of ``num_layers``."""

    # config.json

    def config(self, cfg: Eagle3Config, dtype: torch.dtype, outrider: dict[str, Any], k: int,
               model_type: str | None, verifier: str | None) -> dict[str, Any]:
        """config.json (the ``outrider`` section is passed in and stored as is)."""
        top, nested, _ = self.written_ids(cfg.aux_layer_ids, model_type)
        mla = cfg.attention == "mla"
        return {
            "architectures": [MLA_DRAFT_ARCH if mla else DRAFT_ARCH],
            **(mla_fields(cfg) if mla else llama_fields(cfg)),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            **option_fields(cfg),
            "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(nested)},
            "eagle_aux_hidden_state_layer_ids": list(top),
            **parallel_config(cfg),
            "torch_dtype": dtype_name(dtype),
            "outrider": outrider,
        }

    # reading

    def recognises(self, cfg: dict[str, Any]) -> bool:
        """Whether a folder's config.json is in this format (SGLang's and vLLM's are the same)."""
        if cfg.get("speculators_model_type") is not None:
            return False
        archs = tuple(cfg.get("architectures") or ())
        eagle = cfg.get("eagle_config")
        return isinstance(cfg.get("outrider"), dict) or any(a in EAGLE3_ARCHS for a in archs) \
            or "draft_vocab_size" in cfg or (isinstance(eagle, dict) and bool(eagle))

    def read_layer(self, cfg: dict[str, Any]) -> tuple[dict[str, Any], str, list[str]]:
        """(the dict holding the draft layer's sizes, its name in messages, unsupported features)."""
        return cfg, "the head's config.json", []

    def verifier(self, cfg: dict[str, Any]) -> str | None:
        """The target a config names as its verifier, if the format has one."""
        return None


def rope_fields(cfg: Eagle3Config) -> dict[str, Any]:
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    if scaling is None and cfg.attention == "mla":
        # vLLM's MLA draft takes rope_theta from the scaling dict only (10000 without one): plain RoPE
        # as YaRN of factor 1, which both engines compute as plain RoPE with this theta
        scaling = {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": cfg.max_position_embeddings,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "rope_theta": cfg.rope_theta}
    if scaling is not None:
        scaling.setdefault("type", scaling["rope_type"])  # the pre-transformers-4.45 key some readers still use
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling}


def option_fields(cfg: Eagle3Config) -> dict[str, Any]:
    """EAGLE 3.1 keys, written when set; ``norm_before_residual`` always (vLLM's speculators reader
    defaults it to true when absent)."""
    out: dict[str, Any] = {"norm_before_residual": cfg.norm_before_residual}
    out.update({k: True for k in ("norm_before_fc", "fc_norm", "norm_output") if getattr(cfg, k)})
    return out


def window_fields(cfg: Eagle3Config) -> dict[str, Any]:
    if not cfg.sliding_window:
        return {}
    return {"sliding_window": cfg.sliding_window, "layer_types": ["sliding_attention"], "use_sliding_window": True}


def llama_fields(cfg: Eagle3Config) -> dict[str, Any]:
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        **rope_fields(cfg), "max_position_embeddings": cfg.max_position_embeddings, "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "pretraining_tp": 1, **window_fields(cfg),
    }


def mla_fields(cfg: Eagle3Config) -> dict[str, Any]:
    return {
        "model_type": MLA_DRAFT_MODEL_TYPE, "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_rope_head_dim,  # transformers' DeepseekV3 rotary width (not the query width)
        "rope_interleave": True, "intermediate_size": cfg.intermediate_size, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, **rope_fields(cfg), "max_position_embeddings": cfg.max_position_embeddings,
        "num_hidden_layers": 1, "vocab_size": cfg.vocab_size, "tie_word_embeddings": False, "attention_bias": False,
    }


def parallel_config(cfg: Eagle3Config) -> dict[str, Any]:
    """A P-EAGLE head's keys (none for EAGLE-3): ``mask_token_id``, the placeholder token vLLM's
    proposer reads from the draft's config.json (``llm_base_proposer.py``,
    ``_init_parallel_drafting_params``), and ``parallel_drafting: true``, which vLLM takes from
    --speculative-config instead; outrider reads it back."""
    return {"parallel_drafting": True, "mask_token_id": cfg.mask_token_id} if cfg.parallel_drafting else {}
