"""Proposers by name: the registry ``--method`` takes its choices from (bench, generate).

``PROPOSERS[name]`` is a ``Method``: where its proposer class lives (imported on use, so that the
command line lists the names without importing torch), how its draft loads (``needs``: None, or
a kind of ``interop.drafts.DRAFTS``: ``"model"`` a causal LM with the target's tokenizer,
``"eagle3-head"`` an EAGLE-3 head, ``"parallel-head"`` a P-EAGLE head, ``"dflash"`` a DFlash drafter) and whether it drafts
trees. ``interop.drafts.build_proposer`` loads that draft and hands it, built, to ``build``; a
proposer never loads a checkpoint itself. ``"ar"`` is plain decoding: no proposer. A new
proposer is one file here plus one line below (and, for a new kind of draft, one loader there).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Method:
    path: str | None  # "module:Class" of the proposer (None: plain decoding)
    needs: str | None = None  # how its draft loads: None or a kind of ``interop.drafts.DRAFTS``
    trees: bool = False  # drafts trees (``--tree``, ``--tree-paths``) as well as chains

    def build(self, target: Any, draft: Any = None, **options: Any) -> Any:
        """The proposer (None for plain decoding) for ``target``, from the built ``draft``."""
        if self.path is None:
            return None
        module, name = self.path.split(":")
        return getattr(importlib.import_module(module), name).build(target, draft, **options)


PROPOSERS: dict[str, Method] = {
    "ar": Method(None),
    "ngram": Method("outrider.decode.proposers.ngram:NgramProposer"),
    "draft": Method("outrider.decode.proposers.draft_model:DraftModelProposer", needs="model"),
    "eagle3": Method("outrider.decode.proposers.eagle3:Eagle3Proposer", needs="eagle3-head", trees=True),
    "parallel": Method("outrider.decode.proposers.parallel:ParallelProposer", needs="parallel-head"),  # P-EAGLE
    "dflash": Method("outrider.decode.proposers.dflash:DFlashProposer", needs="dflash"),  # DFlash block drafter
}
