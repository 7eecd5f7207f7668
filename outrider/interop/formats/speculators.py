"""The ``speculators`` export format (vllm-project/speculators): ``Eagle3Speculator``.

Contract: the same weights under ``layers.0.*`` names (no ``d2t``/``t2d`` when the draft vocabulary
is the target's), the Llama layer in ``transformer_layer_config``, ``speculators_config`` naming the
verifier by a path or hub id that resolves, the top-level ids only (vLLM's reading), and the
target's embedding (speculators fills a missing one only while it is NaN). GQA heads only; vLLM
loads it, SGLang does not. A folder is one when its config has ``speculators_model_type``.
A parallel-drafting head is written as speculators' P-EAGLE (``speculators_model_type: "peagle"``,
``mask_token_id``, ``mask_hidden`` [1, 1, n_aux * H]; needs H = H_t).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from outrider.errors import UserError
from outrider.interop.engines import SPECULATORS_ARCH
from outrider.interop.formats.base import LAYERS0, AuxIds, HeadFormat, dtype_name, llama_fields

if TYPE_CHECKING:
    import torch

    from outrider.heads.eagle3 import Eagle3Config


PEAGLE_ARCH = "PEagleSpeculator"  # speculators' P-EAGLE config default architecture


class SpeculatorsFormat(HeadFormat):
    name = "speculators"
    source = "speculators"
    holds_mla = False
    carries_target = True
    vllm_notes = ("- speculators format: vLLM maps `Eagle3Speculator` to its EAGLE-3 Llama draft; "
                  "`speculators_config.verifier.name_or_path` names the target it was trained for.",)
    sglang_refusal = "SGLang does not load the speculators format: export with `--format sglang`."
    mask_hidden_dims = 3  # PEagleDraftModel.mask_hidden: [1, 1, n_aux * hidden_size]

    def layer_prefix(self, attention: str) -> str:
        return LAYERS0

    def tensor_names(self, cfg: Eagle3Config, ours: Iterable[str]) -> set[str]:
        names = super().tensor_names(cfg, ours)
        if cfg.draft_vocab_size == cfg.vocab_size:  # speculators registers no vocab buffers
            names -= {"d2t", "t2d"}
        return names

    def written_ids(self, ids: tuple[int, ...], model_type: str | None) -> AuxIds:
        return ids, None, "speculators format: top-level ids only (vLLM's reading)"

    def config(self, cfg: Eagle3Config, dtype: torch.dtype, outrider: dict[str, Any], k: int,
               model_type: str | None, verifier: str | None) -> dict[str, Any]:
        if cfg.attention == "mla":
            raise UserError("the speculators format holds Llama (GQA) drafts only: export an MLA head with "
                            "--format vllm or --format sglang")
        if cfg.parallel_drafting and cfg.hidden_size != cfg.target_hidden_size:
            raise UserError(f"speculators' P-EAGLE model sizes mask_hidden by the draft's hidden size "
                            f"({cfg.hidden_size}), this head's is n_aux x the target's ({cfg.target_hidden_size}): "
                            "export it with --format vllm")
        top, _, _ = self.written_ids(cfg.aux_layer_ids, model_type)
        layer = llama_fields(cfg)
        layer["rope_parameters"] = cfg.rope_parameters()
        target = outrider.get("target") or {}
        # P-EAGLE: speculators' ``PEagleSpeculatorConfig`` ("peagle", arch PEagleSpeculator, mask_token_id);
        # vLLM maps it to eagle3 with parallel drafting
        peagle = {"speculators_model_type": "peagle", "mask_token_id": cfg.mask_token_id} if cfg.parallel_drafting \
            else {}
        return {
            "architectures": [PEAGLE_ARCH if cfg.parallel_drafting else SPECULATORS_ARCH],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": list(target.get("architectures") or [])},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(top),
            "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
            "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
            "embed_requires_grad": False,
            "torch_dtype": dtype_name(dtype),
            "outrider": outrider,
            **peagle,
        }

    def recognises(self, cfg: dict[str, Any]) -> bool:
        return cfg.get("speculators_model_type") is not None

    def read_layer(self, cfg: dict[str, Any]) -> tuple[dict[str, Any], str, list[str]]:
        if cfg.get("speculators_model_type") not in ("eagle3", "peagle"):
            raise UserError(f"speculators model type '{cfg.get('speculators_model_type')}' is not an EAGLE-3 head")
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise UserError("speculators config has no 'transformer_layer_config': not an EAGLE-3 speculator")
        unsupported = [f"a {layer.get('model_type')} draft layer"] if layer.get("model_type") not in (None, "llama") \
            else []
        return layer, "the speculators transformer_layer_config", unsupported

    def verifier(self, cfg: dict[str, Any]) -> str | None:
        return ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or None


FORMAT = SpeculatorsFormat()
