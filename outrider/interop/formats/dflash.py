"""DFlash drafters on disk: the layout vLLM's DFlash loader reads (z-lab's), written and read back.

Contract:
- ``is_dflash(cfg)``: a config.json dict describes a DFlash drafter (an architecture naming DFlash,
  a ``dflash_config`` section, or our ``outrider.drafter``).
- ``write_dflash(drafter, out, target, dtype, extra, num_speculative_tokens)`` writes ``out/``
  atomically: ``config.json`` (a Qwen3 config with ``architectures: ["DFlashDraftModel"]``,
  ``block_size``, ``num_target_layers``, ``dflash_config`` {``target_layer_ids`` (our aux ids minus
  one: the layer whose output is read; vLLM adds one back), ``mask_token_id``, ``causal: false``},
  ``layer_types`` all full attention, and the ``outrider`` section with our config), the tensors
  of ``heads.dflash`` under the same names (``d2t``/``t2d`` only for a reduced vocabulary; no
  embedding: the engines share the target's) and ``LAUNCH.md`` (vLLM's command; SGLang drafts
  through the target's lm_head, not this one). The folder is read back, from its ``outrider``
  section and again from the engine fields alone, before it replaces ``out``: both drafters'
  logits on random inputs must equal the drafter's.
- ``read_dflash(path, target_config)``: the drafter of such a folder (ours, or one whose config
  carries the same engine fields and which ships its own ``lm_head``; a z-lab / SpecForge drafter
  without one, drafting through the target's, is refused in one line), checked against the target when given: width,
  vocabulary, aux ids within its layers, the mask token inside the vocabulary. Any missing,
  unknown or misshapen tensor is a one-line ``UserError``.
- ``dflash_issues(cfg, target_config)``: the same checks as a list of lines (``inspect``).
- ``layout="speculators"`` writes speculators' DFlash layout instead (``DFlashSpeculatorConfig``:
  ``speculators_model_type: "dflash"``, the Qwen3 fields in ``transformer_layer_config``,
  ``aux_hidden_state_layer_ids`` = our aux ids, ``mask_token_id``, ``block_size``, the
  ``speculators_config`` naming the verifier, which speculators' class reads the embedding from;
  the same tensors). ``sliding_window_non_causal`` is written true: our layers are all full
  attention, which speculators always runs bidirectionally, and vLLM 0.32 turns a false value
  into ``dflash_config.causal: true`` for every layer. A full-vocabulary drafter is refused there:
  speculators replaces its lm_head with the verifier's. ``read_dflash`` reads both layouts.

Not done here: quantised drafters, a separately trained mask embedding (``mask_embedding.pt``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from outrider import __version__
from outrider.errors import UserError
from outrider.fsutil import atomic_dir
from outrider.heads.dflash import DRAFTER, DFlashConfig, DFlashDrafter
from outrider.heads.eagle3 import rope_from_config
from outrider.models import arch_info
from outrider.outputs import OWN_FILES
from outrider.values import check_draft_map, check_finite

ARCHITECTURE = "DFlashDraftModel"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


LAYOUTS = ("vllm", "speculators")
SPECULATORS_ARCH = "DFlashSpeculator"  # DFlashSpeculatorConfig's default architecture


def is_dflash(cfg: dict[str, Any]) -> bool:
    archs = " ".join(str(a) for a in cfg.get("architectures") or [] if isinstance(a, str))
    ours = cfg.get("outrider") if isinstance(cfg.get("outrider"), dict) else {}
    return ("DFlash" in archs or isinstance(cfg.get("dflash_config"), dict) or ours.get("drafter") == DRAFTER
            or cfg.get("speculators_model_type") == "dflash")


def _qwen3_fields(cfg: DFlashConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The drafter's layers as a Qwen3 config (both layouts)."""
    rope = {"rope_theta": cfg.rope_theta, "rope_parameters": cfg.rope_parameters()}
    if cfg.rope_scaling:
        rope["rope_scaling"] = dict(cfg.rope_scaling)
    return {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, **rope, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers, "use_sliding_window": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _config_json(cfg: DFlashConfig, dtype: torch.dtype, section: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE], **_qwen3_fields(cfg, dtype), "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,
        "dflash_config": {"target_layer_ids": cfg.target_layer_ids, "mask_token_id": cfg.mask_token_id,
                          "causal": False},
        "outrider": section,
    }


def _speculators_json(cfg: DFlashConfig, dtype: torch.dtype, section: dict[str, Any], verifier: str | None,
                      verifier_archs: list[str], k: int) -> dict[str, Any]:
    """speculators' ``DFlashSpeculatorConfig`` for the drafter (module docstring); ``k`` drafts per
    round in its proposal method, as LAUNCH.md asks."""
    return {
        "architectures": [SPECULATORS_ARCH], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_archs},
        },
        "transformer_layer_config": _qwen3_fields(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size, "block_size": cfg.block_size,
        "target_hidden_size": cfg.target_hidden_size, "num_target_layers": cfg.num_target_layers,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "mask_token_id": cfg.mask_token_id, "sliding_window_non_causal": True, "sample_from_anchor": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "outrider": section,
    }


def _tensors(drafter: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    cfg = drafter.config
    out = {}
    for name, value in drafter.state_dict().items():
        if name in ("d2t", "t2d"):
            if cfg.draft_vocab_size < cfg.vocab_size:
                out[name] = value.detach().cpu().contiguous()
            continue
        out[name] = value.detach().to("cpu", dtype).contiguous()
    return out


def launch_k(cfg: DFlashConfig, num_speculative_tokens: int | None) -> int:
    """The drafts per round an export asks the engines for: the one given, at most the block's."""
    return min(num_speculative_tokens, cfg.max_draft) if num_speculative_tokens else cfg.max_draft


def launch_text(cfg: DFlashConfig, out: Path, target: str | None, num_speculative_tokens: int | None) -> str:
    """LAUNCH.md: each engine's command for this drafter."""
    k = launch_k(cfg, num_speculative_tokens)
    tgt = target or "TARGET"
    spec = {"method": "dflash", "model": str(out), "num_speculative_tokens": k}
    return "\n".join([
        "# Serving this DFlash drafter", "",
        f"A block drafter: one forward drafts up to {cfg.max_draft} tokens (block_size {cfg.block_size}). "
        f"It reads the target's layer outputs {cfg.target_layer_ids} (outrider aux ids {list(cfg.aux_layer_ids)}) "
        f"and uses token {cfg.mask_token_id} as its mask.", "",
        "## vLLM", "", "```bash", f"vllm serve {tgt} \\", f"  --speculative-config '{json.dumps(spec)}'", "```", "",
        f"`num_speculative_tokens` {cfg.max_draft} runs the block this drafter was trained on; fewer masks change "
        f"the block its (non-causal) attention sees and usually accept less, more were never trained.", "",
        "## SGLang", "",
        "Not served: SGLang's DFlash model drafts through the target's lm_head and ignores a drafter's own "
        "`lm_head` and `d2t`, which this drafter needs (its draft vocabulary is its own).", ""])


def write_dflash(drafter: DFlashDrafter, out: str | Path, target: str | None = None, dtype: str = "bfloat16",
                 extra: dict[str, Any] | None = None, num_speculative_tokens: int | None = None,
                 target_config: Any = None, layout: str = "vllm", verifier: str | None = None,
                 verifier_archs: list[str] | None = None) -> dict[str, Any]:
    """Write ``drafter`` to ``out`` in ``layout`` (module docstring; ``verifier``: speculators'
    ``verifier.name_or_path``); returns what was written (files, max logit difference)."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    if layout not in LAYOUTS:
        raise UserError(f"unknown DFlash layout '{layout}': use one of {', '.join(LAYOUTS)}")
    torch_dtype = DTYPES[dtype]
    cfg = drafter.config
    if layout == "speculators" and cfg.draft_vocab_size == cfg.vocab_size:
        raise UserError("speculators replaces a full-vocabulary DFlash drafter's lm_head with its verifier's, and "
                        "this drafter's is its own: export it with --format vllm")
    if layout == "speculators" and not verifier:
        raise UserError("the speculators layout names the verifier (speculators reads its embedding there): pass "
                        "--target")
    if target_config is not None:
        problems = dflash_issues(cfg, target_config)
        if problems:
            raise UserError(f"the DFlash drafter does not fit the target: {problems[0]}")
    section = {**(extra or {}), "drafter": DRAFTER, "version": __version__, "config": cfg.to_dict(),
               "format": "dflash" if layout == "vllm" else "speculators"}
    if target is not None:
        section["target"] = {"name": target}
    config = (_config_json(cfg, torch_dtype, section) if layout == "vllm"
              else _speculators_json(cfg, torch_dtype, section, verifier, list(verifier_archs or []),
                                     launch_k(cfg, num_speculative_tokens)))
    out = Path(out).expanduser().resolve()
    tensors = _tensors(drafter, torch_dtype)
    reference = copy.deepcopy(drafter).to(device="cpu", dtype=torch_dtype).eval()
    from safetensors.torch import save_file

    with atomic_dir(out, carry=OWN_FILES) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "LAUNCH.md").write_text(launch_text(cfg, out, target, num_speculative_tokens))
        reloaded = read_dflash(tmp, target_config, dtype=torch_dtype)
        engine_cfg = _config_from_json({k: v for k, v in json.loads((tmp / "config.json").read_text()).items()
                                        if k != "outrider"}, tmp)
        if engine_cfg != cfg:
            raise UserError(f"the engine fields written for the DFlash drafter read back as another drafter: "
                            f"nothing was written to {out}")
        diff = random_check(reference, reloaded)
        if not diff <= (1e-5 if torch_dtype == torch.float32 else 1e-2):
            raise UserError(f"the written DFlash drafter does not reproduce the drafter (max logit difference "
                            f"{diff:.3g}): nothing was written to {out}")
        files = sorted(p.name for p in tmp.iterdir())
    return {"out": str(out), "files": files, "num_tensors": len(tensors), "dtype": dtype, "max_abs_logit_diff": diff}


@torch.no_grad()
def random_check(a: DFlashDrafter, b: DFlashDrafter, seed: int = 0, S: int = 6) -> float:
    """Max |logit difference| of two drafters on one random context and block."""
    g = torch.Generator().manual_seed(seed)
    cfg = a.config
    dtype = a.fc.weight.dtype
    aux = torch.randn(1, S, a.fc.in_features, generator=g).to(dtype)
    embeds = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=g).to(dtype)
    ctx_pos = torch.arange(S)[None]
    pos = torch.arange(S, S + cfg.block_size)[None]
    mask = torch.ones(1, 1, cfg.block_size, S + cfg.block_size, dtype=torch.bool)
    la = a.compute_logits(a.block(embeds, pos, a.context_kv(aux, ctx_pos), mask)).float()
    lb = b.compute_logits(b.block(embeds, pos, b.context_kv(aux, ctx_pos), mask)).float()
    return float((la - lb).abs().max())


def _unlike_ours(raw: dict[str, Any]) -> str:
    """What in an engine-layout config makes its drafter compute other than ours (empty: nothing)."""
    layer = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else {}
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    types = [t for c in (raw, layer) if isinstance(c.get("layer_types"), list)
             for t in c["layer_types"] if t != "full_attention"]
    if types:
        return f"layer types {sorted(set(map(str, types)))}"
    if raw.get("sample_from_anchor") is True:
        return "sample_from_anchor (its block starts at a sampled anchor)"
    if dflash.get("causal") is True:
        return "causal attention in its block"
    return ""


def _config_from_json(raw: dict[str, Any], path: Path) -> DFlashConfig:
    """Our config from the ``outrider`` section, else from the engine fields (a z-lab/SpecForge drafter,
    or speculators' layout, whose aux ids are ours)."""
    ours = raw.get("outrider") if isinstance(raw.get("outrider"), dict) else {}
    if isinstance(ours.get("config"), dict):
        return DFlashConfig.from_dict(ours["config"])
    unlike = _unlike_ours(raw)
    if unlike:
        raise UserError(f"{path}/config.json: a DFlash drafter with {unlike}: outrider drafts with full, "
                        "non-causal attention over the block after the newest token, and would draft other tokens")
    if raw.get("speculators_model_type") == "dflash":
        layer = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else {}
        ids = raw.get("aux_hidden_state_layer_ids")
        top = {k: raw[k] for k in ("draft_vocab_size", "block_size", "target_hidden_size", "num_target_layers",
                                   "mask_token_id") if k in raw}
        dflash = {"mask_token_id": raw.get("mask_token_id")}
        if isinstance(ids, list):
            dflash["target_layer_ids"] = [j - 1 if isinstance(j, int) else j for j in ids]
        raw = {**layer, **top, "dflash_config": dflash}
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    try:
        ids = dflash.get("target_layer_ids") or raw["target_layer_ids"]
        rope_theta, rope_scaling = rope_from_config(raw)
        return DFlashConfig(
            hidden_size=int(raw["hidden_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
            vocab_size=int(raw["vocab_size"]), draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or raw["hidden_size"]),
            aux_layer_ids=tuple(int(j) + 1 for j in ids), block_size=int(raw.get("block_size") or dflash["block_size"]),
            mask_token_id=int(dflash.get("mask_token_id", raw.get("mask_token_id"))),
            num_target_layers=int(raw.get("num_target_layers") or 0))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}/config.json is not a DFlash drafter outrider can read (field {e})") from None


def dflash_issues(cfg: DFlashConfig, target_config: Any) -> list[str]:
    """Why the drafter cannot serve the target, one line each (empty: it fits)."""
    target = target_config if isinstance(target_config, dict) else target_config.to_dict()
    info = arch_info(target)
    out = []
    if cfg.target_hidden_size != info.hidden_size:
        out.append(f"it reads states {cfg.target_hidden_size} wide, the target's are {info.hidden_size}")
    if cfg.hidden_size != info.hidden_size:
        out.append(f"its width {cfg.hidden_size} differs from the target's {info.hidden_size} (the engines share "
                   "the target's embedding)")
    if cfg.vocab_size != info.vocab_size:
        out.append(f"its vocabulary ({cfg.vocab_size}) differs from the target's ({info.vocab_size})")
    if max(cfg.aux_layer_ids) > info.num_layers:
        out.append(f"target_layer_ids {cfg.target_layer_ids} reach past the target's {info.num_layers} layers")
    if cfg.num_target_layers and cfg.num_target_layers != info.num_layers:
        out.append(f"it was trained for a target of {cfg.num_target_layers} layers, this one has {info.num_layers}")
    return out


def read_dflash(path: str | Path, target_config: Any = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> DFlashDrafter:
    """The drafter in ``path`` (module docstring), on ``device`` in ``dtype``, in eval mode."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}/config.json cannot be read: {e}") from None
    cfg = _config_from_json(raw, path)
    if target_config is not None:
        problems = dflash_issues(cfg, target_config)
        if problems:
            raise UserError(f"{path}: the DFlash drafter does not fit the target: {problems[0]}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} holds no .safetensors file: not a DFlash drafter")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    for name in ("embed_tokens.weight", "model.embed_tokens.weight"):
        state.pop(name, None)  # the target's, carried by some layouts: the engines share the target's own
    if "lm_head.weight" not in state:
        raise UserError(f"{path} has no lm_head: a drafter that drafts through the target's lm_head (the z-lab / "
                        "SpecForge layout) is served by the engines but not run by outrider, whose drafters carry "
                        "their own")
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    if "d2t" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise UserError(f"{path} has no d2t although its draft vocabulary is reduced: draft ids cannot be mapped")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(cfg.draft_vocab_size) + state["d2t"].long()] = True
    unknown, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
    if unknown or missing:
        parts = ([f"unknown tensors {unknown[:4]}"] if unknown else []) + ([f"missing tensors {missing[:4]}"]
                                                                            if missing else [])
        raise UserError(f"{path}: {'; '.join(parts)}: not a DFlash drafter outrider can load")
    wrong = [f"{k} {tuple(state[k].shape)} != {v}" for k, v in expected.items() if tuple(state[k].shape) != v]
    if wrong:
        raise UserError(f"{path}: tensor shapes disagree with its config.json: {'; '.join(wrong[:3])}")
    check_draft_map(state["d2t"], state["t2d"], cfg.vocab_size, str(path))
    check_finite(state, str(path), "the drafter is damaged (a training run that diverged?)")
    d2t, t2d = state.pop("d2t").long(), state.pop("t2d").bool()
    drafter.load_state_dict({**{k: v.float() for k, v in state.items()}, "d2t": d2t.clone(), "t2d": t2d.clone()},
                            strict=True, assign=True)
    drafter.rotary = type(drafter.rotary)(cfg)  # computed, not loaded: built for real
    drafter.set_vocab(d2t, t2d)
    return drafter.to(device=device, dtype=dtype).eval()
