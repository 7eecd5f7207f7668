"""The ``sglang`` export format: the EAGLE-3 draft config with ``eagle_config`` ids SGLang reads.

Contract: the layout and config of ``HeadFormat``; ``eagle_config`` holds the ids that make SGLang
capture the head's layers on this target (its +1 rule, ``engines.sglang_writes``), and ids SGLang
cannot be made to read, or the target's last layer output (never captured by SGLang), are refused,
as are parallel-drafting (P-EAGLE) heads, which SGLang does not serve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outrider.errors import UserError
from outrider.interop.engines import sglang_writes
from outrider.interop.formats.base import AuxIds, HeadFormat

if TYPE_CHECKING:
    from outrider.heads.eagle3 import Eagle3Config


class SGLangFormat(HeadFormat):
    name = "sglang"
    engine = "sglang"

    def written_ids(self, ids: tuple[int, ...], model_type: str | None) -> AuxIds:
        nested, note = sglang_writes(ids, model_type)
        if nested is None:
            raise UserError(f"{note}: export with --format vllm (vLLM reads the ids as they are)")
        return ids, nested, note

    def check_ids(self, ids: tuple[int, ...], num_layers: int | None) -> None:
        if num_layers and max(ids) >= num_layers:
            raise UserError(f"aux id {max(ids)} is the target's last layer output, which SGLang never "
                            "captures (it captures before each layer): export with --format vllm")

    def config(self, cfg: Eagle3Config, *args: Any) -> dict[str, Any]:
        if cfg.parallel_drafting:  # its open PEAGLE PR (sglang#27498) uses no learned mask_hidden
            raise UserError("SGLang serves no P-EAGLE (parallel-drafting) heads: export this head with --format vllm "
                            "or --format speculators")
        return super().config(cfg, *args)


FORMAT = SGLangFormat()
