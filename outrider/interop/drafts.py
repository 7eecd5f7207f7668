"""Drafts loaded by their kind: what ``--draft`` names for a method, loaded, checked, handed to its proposer.

Contract: a proposer-registry entry (``decode.proposers.PROPOSERS``) names in ``needs`` the kind
of draft it is built from, a key of ``DRAFTS``: None (no draft), ``"model"`` (a causal LM with the
target's vocabulary and tokenizer), ``"eagle3-head"`` (an EAGLE-3 head, drafting a chain or a
tree), ``"parallel-head"`` (a parallel-drafting P-EAGLE head) or ``"dflash"`` (a DFlash block drafter). ``build_proposer(method, entry,
target, ...)`` is the one place a draft is loaded for decoding (bench, generate, the demo, the
served bench's offline run): it loads the draft of the entry's kind from ``draft`` on the
target's device and dtype, refuses a draft of another kind (one line naming the method), a tree
for a method that drafts chains, and returns ``entry.build(target, built_draft, **options)``.
``folder_kind(path)`` tells a head's folder from a model's by its config alone, before anything
loads (the command line's early check).

Not done here: the proposers themselves (``decode``: they receive built drafts and never load),
reading checkpoint layouts (``checkpoint``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from outrider.errors import UserError, require


@dataclass(frozen=True)
class DraftKind:
    what: str  # the draft in words, for help and errors
    folder: str  # what ``folder_kind`` calls its folder: "head" or "model"
    load: Callable[..., Any]  # (method, path, target, tokenizer, device, dtype) -> the built draft


def _load_model(method: str, path: str, target: Any, tokenizer: Any, device: Any, dtype: Any) -> Any:
    from outrider.models import load_model

    built, draft_tok = load_model(path, device=device, dtype=dtype)
    check_pair(target, built, tokenizer, draft_tok)
    return built


def check_pair(target: Any, draft: Any, target_tok: Any = None, draft_tok: Any = None) -> None:
    """Refuse a draft model that cannot propose target tokens (other vocabulary or tokenizer)."""
    vt, vd = target.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0]
    require(vt == vd, f"draft vocabulary size {vd} differs from the target's {vt}: "
                      "use a draft with the target's tokenizer")
    if target_tok is not None and draft_tok is not None:
        require(target_tok.get_vocab() == draft_tok.get_vocab(),
                "draft tokenizer differs from the target's (same size, other tokens): "
                "use a draft trained with the target's tokenizer")


def load_head_for(path: str | Path, target: Any, device: Any = None) -> Any:
    """The head at ``path`` (any layout ``checkpoint.load_head`` reads), checked against ``target``,
    on the target's device (or ``device``) and dtype, frozen."""
    from outrider.interop.checkpoint import load_head

    head, _ = load_head(path, target_config=target.config)
    param = next(target.parameters())
    return head.to(device=device or param.device, dtype=param.dtype).eval().requires_grad_(False)


def _refuse_dflash(head: Any, path: str, method: str) -> None:
    if getattr(head.config, "block_size", None) is not None:
        raise UserError(f"{path} is a DFlash block drafter: use --method dflash, not --method {method}")


def _load_eagle3_head(method: str, path: str, target: Any, tokenizer: Any, device: Any, dtype: Any) -> Any:
    head = load_head_for(path, target, device)
    _refuse_dflash(head, path, method)
    if head.config.parallel_drafting:
        raise UserError(f"{path} is a parallel-drafting (P-EAGLE) head, trained to draft all k tokens in one "
                        f"forward: use --method parallel, not --method {method}")
    return head


def _load_parallel_head(method: str, path: str, target: Any, tokenizer: Any, device: Any, dtype: Any) -> Any:
    head = load_head_for(path, target, device)
    _refuse_dflash(head, path, method)
    if not head.config.parallel_drafting:
        raise UserError(f"--method {method} needs a parallel-drafting head; {path} is an EAGLE-3 head: use "
                        "--method eagle3, or train one with 'outrider train --parallel-drafting'")
    return head


def _load_dflash(method: str, path: str, target: Any, tokenizer: Any, device: Any, dtype: Any) -> Any:
    drafter = load_head_for(path, target, device)
    if getattr(drafter.config, "block_size", None) is None:
        raise UserError(f"--method {method} needs a DFlash drafter; {path} is an EAGLE-3 head: use --method "
                        f"{'parallel' if drafter.config.parallel_drafting else 'eagle3'}, or train one with "
                        "'outrider train --drafter dflash'")
    return drafter


DRAFTS: dict[str, DraftKind] = {
    "model": DraftKind("a draft model", "model", _load_model),
    "eagle3-head": DraftKind("an EAGLE-3 head", "head", _load_eagle3_head),
    "parallel-head": DraftKind("a parallel-drafting (P-EAGLE) head", "head", _load_parallel_head),
    "dflash": DraftKind("a DFlash block drafter", "head", _load_dflash),
}


def build_proposer(method: str, entry: Any, target: Any, tokenizer: Any = None, draft: str | None = None,
                   device: Any = None, dtype: Any = None, tree: Any = None, **options: Any) -> Any:
    """The proposer of registry entry ``entry`` (``PROPOSERS[method]``; None for plain decoding) for
    ``target``, its draft loaded from ``draft`` by the entry's kind (on ``device`` and in ``dtype``,
    the target's by default); ``tree`` (``outrider.trees``) for an entry that drafts trees;
    ``options`` the method's own settings."""
    require(tree is None or entry.trees, f"--method {method} drafts chains; trees need --method eagle3")
    built = None
    if entry.needs is not None:
        require(draft is not None, f"--method {method} needs --draft")
        param = next(target.parameters())
        built = DRAFTS[entry.needs].load(method, draft, target, tokenizer, device or param.device, dtype or param.dtype)
    if tree is not None:
        options["tree"] = tree
    return entry.build(target, built, **options)


def folder_kind(path: str) -> str | None:
    """'head' (an EAGLE-3 or P-EAGLE head's config), 'model' (a causal LM's), or None (nothing to
    tell from)."""
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        return "model" if folder.is_file() else None  # a GGUF file is a model
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(cfg, dict):
        return None
    archs = " ".join(str(a) for a in cfg.get("architectures") or [] if isinstance(a, str)).lower()
    head_keys = ("eagle_config", "speculators_config", "speculators_model_type", "draft_vocab_size", "outrider")
    head_keys += ("dflash_config",)
    return "head" if "eagle" in archs or "dflash" in archs or any(k in cfg for k in head_keys) else "model"
