"""The ``vllm`` export format (and outrider's own checkpoint layout): the EAGLE-3 draft config.

Contract: the layout and config of ``HeadFormat``; vLLM reads the top-level ids verbatim.
``eagle_config`` holds the ids SGLang would need on this target when they can be known, else the
ids unshifted, with a note saying so.
"""

from __future__ import annotations

from outrider.errors import UserError
from outrider.interop.engines import sglang_writes
from outrider.interop.formats.base import AuxIds, HeadFormat


class VLLMFormat(HeadFormat):
    name = "vllm"

    def written_ids(self, ids: tuple[int, ...], model_type: str | None) -> AuxIds:
        try:
            nested, note = sglang_writes(ids, model_type)
        except UserError as e:
            return ids, ids, f"unshifted; SGLang's reading of them needs the target ({e})"
        if nested is None:
            return ids, ids, f"unshifted: {note}"
        return ids, nested, note


FORMAT = VLLMFormat()
