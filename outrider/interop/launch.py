"""LAUNCH.md of an exported head: the vLLM and SGLang command lines, and what each engine will read.

Contract: ``launch_text(...)`` returns the Markdown an export writes next to its weights: for each
engine that can serve the head as written, the launch command (with the server flags the head
needs: SGLang's draft window; a chain of k, or the draft tree measured best as SGLang's EAGLE-2
budget, vLLM being given the chain of the tree's depth, since it serves no trees) and how it reads
the aux ids and options, with the engine version each was checked on; for an engine that cannot,
one line saying why (``engines`` holds the facts).

Not done here: choosing or writing the ids (``formats``: each format adds its own lines),
checking a folder (``inspect``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from outrider.heads.eagle3 import AUX_IDS_SEMANTICS, Eagle3Config
from outrider.interop.engines import (
    CHECKED_ON,
    MLA_SERVED_BY,
    VLLM_CHAINS_ONLY,
    SGLANG_RULE_NOTE,
    kv_bytes_per_token,
    option_issues,
)
from outrider.interop.formats.base import HeadFormat
from outrider.models import arch_info
from outrider.trees import StaticTree, TreeSpec, shape_of


def _vllm_tree_lines(tree: TreeSpec | None, spec: dict[str, Any]) -> list[str]:
    """What vLLM does with a draft tree: nothing (``engines.VLLM_CHAINS_ONLY``); the command above is
    the chain of the tree's depth."""
    if tree is None:
        return []
    return [f"- {VLLM_CHAINS_ONLY}. The command above is the chain of k = {spec['num_speculative_tokens']} (the "
            "tree's depth); SGLang below runs the measured tree."]


PARALLEL_VLLM = ("- Parallel drafting (P-EAGLE): `\"parallel_drafting\": true` makes vLLM draft all k tokens in one "
                 "forward (placeholder token {token}, config `mask_token_id`; learned `mask_hidden`); without it "
                 "vLLM runs this head as an EAGLE-3 chain, for which it was not trained. Keep k at or below the "
                 "depth it was trained for (ttt_steps).")
PARALLEL_SGLANG = ("SGLang serves no P-EAGLE (parallel-drafting) heads: serve this head with vLLM "
                   "(`parallel_drafting`), or export it with --format vllm or --format speculators.")


def launch_text(fmt: HeadFormat, out: Path, cfg: Eagle3Config, top: Sequence[int], nested: Sequence[int] | None,
                nested_note: str, target: str | None, target_cfg: dict[str, Any] | None,
                model_type: str | None, k: int = 3, tree: TreeSpec | None = None) -> str:
    """LAUNCH.md: the engine command lines for this head and what to watch out for. ``tree``: the
    draft tree the commands run (SGLang: its budget; vLLM: a static tree's paths) instead of a
    chain of ``k``."""
    tgt = str(target) if target and str(target) != "default" else "<target model>"
    info = arch_info(target_cfg) if target_cfg is not None else None
    remote = bool(target_cfg and (target_cfg.get("auto_map") or str(info.model_type).startswith("kimi")))
    trc = " --trust-remote-code" if remote else ""
    spec: dict[str, Any] = {"method": "eagle3", "model": str(out), "num_speculative_tokens": k}
    if cfg.parallel_drafting:  # P-EAGLE: vLLM drafts all k in one forward only when told so
        spec["parallel_drafting"] = True
    topk, steps, draft_tokens = shape_of(tree, k)
    if tree is not None:  # vLLM drafts no trees: the chain of the tree's depth
        spec["num_speculative_tokens"] = steps
    mla = cfg.attention == "mla"
    written = f"top-level {list(top)} (vLLM)" + ("" if nested is None else f", eagle_config {list(nested)} (SGLang)")
    lines = [f"# Serving this EAGLE-3 head ({fmt.name} format, {'MLA' if mla else 'GQA'} attention)", "",
             f"Aux layer ids (outrider meaning: {AUX_IDS_SEMANTICS}): {list(cfg.aux_layer_ids)}; "
             f"written in config.json as {written}.", ""]
    kv = kv_bytes_per_token(cfg)
    if mla:
        lines += [f"- MLA draft (`Eagle3DeepseekV2ForCausalLM`), served by {MLA_SERVED_BY}. Its KV cache takes "
                  f"{kv['engine']} B per token in bf16 (latent {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}), "
                  "on the target's MLA attention backend.", ""]
    options = {k_: getattr(cfg, k_) for k_ in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc",
                                                "sliding_window")}
    v_block, v_caveats = option_issues(cfg.attention, options, "vllm")
    lines += ["## vLLM", "", f"Checked on vLLM {CHECKED_ON['vllm'][0]} ({CHECKED_ON['vllm'][1]}).", ""]
    if v_block:
        lines += [f"vLLM does not read {', '.join(v_block)} for this draft: it cannot serve this head.", ""]
    else:
        lines += ["```bash", f"vllm serve {tgt}{trc} \\", f"  --speculative-config '{json.dumps(spec)}'", "```", "",
                  "- vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` as written (id j = the state "
                  "entering layer j) and defaults to (2, L//2, L-3) without them.", *(f"- {c}" for c in v_caveats),
                  *_vllm_tree_lines(tree, spec)]
        lines += list(fmt.vllm_notes)
        if cfg.parallel_drafting:
            lines.append(PARALLEL_VLLM.format(token=cfg.mask_token_id))
        if info is not None and info.attention == "MLA" and not mla:
            mla_spec = dict(spec, attention_backend="FLASH_ATTN")
            lines += ["- MLA target, GQA draft: if the draft fails to start on an MLA-only attention backend, give "
                      "it its own backend (vLLM PR 39930):", "", "```bash",
                      f"  --speculative-config '{json.dumps(mla_spec)}'", "```"]
        lines.append("")
    lines += ["## SGLang", "", f"Checked on SGLang {CHECKED_ON['sglang'][0]} ({CHECKED_ON['sglang'][1]}).", ""]
    s_block, s_caveats = option_issues(cfg.attention, options, "sglang")
    if cfg.parallel_drafting:
        lines += [PARALLEL_SGLANG, ""]
    elif fmt.sglang_refusal:
        lines += [fmt.sglang_refusal, ""]
    elif nested is None or nested_note.startswith("unshifted") or s_block:
        why = f"it does not read {', '.join(s_block)}" if s_block else nested_note
        lines += [f"SGLang cannot serve this head as written: {why}.", ""]
    else:
        window = f" \\\n  --speculative-draft-window-size {cfg.sliding_window}" if cfg.sliding_window else ""
        lines += ["```bash", f"python -m sglang.launch_server --model-path {tgt}{trc} \\",
                  "  --speculative-algorithm EAGLE3 \\", f"  --speculative-draft-model-path {out} \\",
                  f"  --speculative-num-steps {steps} --speculative-eagle-topk {topk} "
                  f"--speculative-num-draft-tokens {draft_tokens}{window}", "```", "",
                  *(["- SGLang builds EAGLE-2 trees, not static ones: these flags give a dynamic tree of the static "
                     "tree's width, depth and size."] if isinstance(tree, StaticTree) else []),
                  f"- {SGLANG_RULE_NOTE}; the eagle_config ids above are written so that SGLang captures the layers "
                  f"the head was trained on ({nested_note}).", *(f"- {c}" for c in s_caveats), ""]
        if model_type is None:
            lines += ["- The target's model type was not known at export: check the ids with `outrider inspect "
                      "<target> --draft <this folder>`.", ""]
    if info is not None and info.is_moe:
        lines += [f"- MoE target ({info.num_experts} experts, {info.experts_per_token} per token): every verified "
                  "token wakes more experts, so keep chains (top-k 1) and few draft tokens.", ""]
    return "\n".join(lines)
