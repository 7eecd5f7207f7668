"""Reading EAGLE-3 head checkpoints: our layout, vLLM's, SGLang's and speculators'.

Contract: ``read_head_spec(dir)`` describes a head folder from its config alone (architecture,
GQA or MLA sizes, EAGLE 3.1 options, sliding window, aux ids and how each engine reads them,
vocabulary sizes; no weights read), for ``inspect``; ``load_head(dir)`` builds an ``Eagle3Head``
from any of the supported layouts (``midlayer.*`` or ``layers.0.*`` names, SGLang's legacy
``aux_norm_{low,mid,high}``; the speculators wrapper; ``Eagle3DeepseekV2ForCausalLM`` MLA
drafts), checks every tensor's shape, refuses unknown or missing tensors with one line, and
returns the ``outrider`` section of the config (target record, aux-id semantics).
``format_names`` / ``to_format_state_dict`` are the name maps both ways.

Aux ids of a foreign config (``HeadSpec.intended_aux_ids``): the ids outrider recorded; else the
top-level ids (vLLM's and speculators' reading, verbatim); else the ``eagle_config`` ids as SGLang
reads them for the target (``outrider.interop.engines``; without a target only a first id of 1 is
unambiguous); else the engines' default ``(2, L//2, L-3)``.

Not done here: writing (``formats``), compatibility reports (``inspect``)."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from outrider.errors import UserError
from outrider.fsutil import read_json, safetensors_index
from outrider.heads.eagle3 import AUX_IDS_SEMANTICS, Eagle3Config, Eagle3Head
from outrider.heads.mla import MLA_FIELDS
from outrider.interop.engines import (
    DRAFT_ARCH,
    MLA_DRAFT_ARCHS,
    SPECULATORS_ARCH,
    default_ids,
    sglang_captures,
    vllm_captures,
)
from outrider.interop.formats import format_of, get_format
from outrider.interop.formats.base import LAYERS0, OUR_LAYER, rename
from outrider.interop.formats.dflash import is_dflash, read_dflash
from outrider.models import arch_info, load_config_dict
from outrider.values import check_draft_map, check_finite

_LEGACY = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}  # SGLang
# Present in peers' checkpoints but not part of a head: the target's embedding (frozen, shared)
# and speculators' training-only copies of the verifier's head.
_DROPPED_ON_IMPORT = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_OPTION_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


# --------------------------------------------------------------------------------------------
# Reading a head's config.json
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadSpec:
    """What a draft's config.json says, in outrider's terms; needs no weights.

    ``config`` holds the head's sizes and options as stated (``Eagle3Config.unchecked``: a head
    outrider cannot run is still described); its ``aux_layer_ids`` are the ids in outrider's
    meaning when the config alone tells them (``None`` otherwise: see ``intended_aux_ids``).
    ``written_top`` are the ids vLLM reads, ``written_eagle`` the ids SGLang reads (both as written).
    """

    source: str  # "outrider" | "speculators" | "eagle3" (SpecForge, SGLang, SafeAILab, published MLA drafts)
    layout: str  # tensor-name layout: "midlayer" | "layers.0"
    architectures: tuple[str, ...]
    config: Eagle3Config
    num_hidden_layers: int
    written_top: tuple[int, ...] | None
    written_eagle: tuple[int, ...] | None
    aux_ids_note: str
    trained_for: str | None
    target_record: dict[str, Any]
    torch_dtype: str
    quantization: str
    unsupported: tuple[str, ...]  # variant features this head uses that outrider cannot run

    @property
    def aux_layer_ids(self) -> tuple[int, ...] | None:
        return self.config.aux_layer_ids

    @property
    def mla(self) -> dict[str, int]:
        """The MLA sizes (``MLA_FIELDS``) of an MLA head, else empty."""
        return {k: getattr(self.config, k) for k in MLA_FIELDS} if self.config.attention == "mla" else {}

    @property
    def options(self) -> dict[str, bool]:
        return {k: getattr(self.config, k) for k in _OPTION_FLAGS}

    def intended_aux_ids(self, num_layers: int | None = None, model_type: str | None = None
                         ) -> tuple[int, ...] | None:
        """The layers the head was made for (outrider meaning); None when that needs the target."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        if self.written_eagle:
            return None if model_type is None else sglang_captures(self.written_eagle, num_layers or 0, model_type)
        return None if num_layers is None else default_ids(num_layers)

    def eagle3_config(self, target_num_layers: int | None = None, target_model_type: str | None = None
                      ) -> Eagle3Config:
        """The head's ``Eagle3Config``, validated; ids the config leaves to the engines need the target."""
        if self.unsupported:
            raise UserError(f"this EAGLE-3 head uses {', '.join(self.unsupported)}, which outrider does not support")
        ids = self.intended_aux_ids(target_num_layers, target_model_type)
        if ids is None:
            if self.written_eagle:
                raise UserError(f"the head's eagle_config ids {list(self.written_eagle)} mean different layers "
                                "for different targets (SGLang's +1 rule): pass the target")
            raise UserError("the head's config names no aux layer ids: pass the target so the engines' "
                            "default (2, L//2, L-3) can be used")
        return replace(self.config, aux_layer_ids=ids)

    def vllm_reads(self, num_layers: int) -> tuple[int, ...]:
        """The layers vLLM captures for this draft (outrider meaning)."""
        return vllm_captures(self.written_top, num_layers)

    def sglang_reads(self, num_layers: int, model_type: str | None = None) -> tuple[int, ...]:
        """The layers a current SGLang captures for this draft on a target of ``model_type``."""
        return sglang_captures(self.written_eagle, num_layers, model_type)

    def to_dict(self) -> dict[str, Any]:
        """The spec as ``inspect --json`` writes it (``draft_info``)."""
        c = self.config
        return copy.deepcopy({
            "source": self.source, "layout": self.layout, "architectures": self.architectures,
            "attention": c.attention, "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size, "hidden_act": c.hidden_act,
            "num_hidden_layers": self.num_hidden_layers, "written_top": self.written_top,
            "written_eagle": self.written_eagle, "aux_layer_ids": c.aux_layer_ids, "aux_ids_note": self.aux_ids_note,
            "trained_for": self.trained_for, "target_record": self.target_record, "torch_dtype": self.torch_dtype,
            "quantization": self.quantization, "unsupported": self.unsupported, "mla": self.mla,
            "options": self.options, "sliding_window": c.sliding_window,
            "parallel_drafting": bool(c.parallel_drafting),
            "mask_token_id": c.mask_token_id if c.parallel_drafting else None,
        })


def _ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(j, int) and not isinstance(j, bool) for j in value):
        raise UserError(f"aux layer ids {value!r} are not a list of integers: the head's config.json is malformed")
    return tuple(value) or None


def _need(cfg: dict[str, Any], key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise UserError(f"{where} has no '{key}': not an EAGLE-3 head config outrider can read")
    return cfg[key]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return float(params["rope_theta"]), (scaling if scaling.get("rope_type", "default") != "default" else None)
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta") or (scaling.get("rope_theta") if isinstance(scaling, dict) else None)
    return float(theta or 10000.0), (dict(scaling) if isinstance(scaling, dict) else None)


def _plain_if_unit_yarn(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """YaRN with factor 1 is plain RoPE (outrider writes it so for MLA drafts: see ``formats``)."""
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "yarn" and float(scaling.get("factor", 0)) == 1.0:
        return None
    return scaling


def _window(layer: dict[str, Any]) -> int:
    """The sliding window a config asks of its draft layer (0: none), as vLLM's Llama draft reads it:
    ``sliding_window`` with ``layer_types[0] == "sliding_attention"`` (or ``use_sliding_window``)."""
    size = layer.get("sliding_window")
    if not size:
        return 0
    types = layer.get("layer_types")
    if isinstance(types, list) and types:
        return int(size) if types[0] == "sliding_attention" else 0
    return int(size) if layer.get("use_sliding_window") else 0


def _quant_name(cfg: dict[str, Any]) -> str:
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant:
        return str(quant.get("quant_method") or quant.get("format") or "custom")
    return ""


def _aux_known(ours: dict[str, Any] | None, source: str, top: tuple[int, ...] | None,
               eagle: tuple[int, ...] | None) -> tuple[tuple[int, ...] | None, str, str]:
    """(ids known from the config alone, how they were read, source)."""
    recorded = None
    if ours is not None:  # export writes aux_layer_ids; the trainer writes them inside head_config
        head_config = ours.get("head_config") if isinstance(ours.get("head_config"), dict) else {}
        recorded = ours.get("aux_layer_ids", head_config.get("aux_layer_ids"))
        semantics = ours.get("aux_layer_ids_semantics") or head_config.get("aux_layer_ids_semantics")
        if recorded is not None and semantics not in (None, AUX_IDS_SEMANTICS):
            raise UserError(f"the head records aux ids as '{semantics}', outrider expects '{AUX_IDS_SEMANTICS}'")
    if recorded is not None:
        return _ids(recorded), "recorded by outrider", "outrider"
    if top is not None:
        return top, "top-level ids, read verbatim (as vLLM and speculators read them)", source
    if eagle is None:
        return None, "none in the config: the engines use (2, L//2, L-3)", source
    if eagle[0] == 1:
        return (tuple(j + 1 for j in eagle), f"eagle_config ids {list(eagle)} only: read as SGLang reads them "
                f"(+1); vLLM ignores them and uses (2, L//2, L-3)", source)
    return None, (f"eagle_config ids {list(eagle)} only: their meaning follows SGLang's rule for the target; "
                  f"vLLM ignores them and uses (2, L//2, L-3)"), source


def head_spec_from_config(cfg: dict[str, Any], readme: str = "") -> HeadSpec:
    """Describe a head from its config.json dict (and, optionally, its README's front matter)."""
    if not isinstance(cfg, dict):
        raise UserError("the head's config.json is not a JSON object")
    ours = cfg.get("outrider") if isinstance(cfg.get("outrider"), dict) else None
    archs = tuple(cfg.get("architectures") or ())
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    fmt = format_of(cfg)
    if fmt is None:
        raise UserError(f"config architectures {list(archs)} do not describe an EAGLE-3 head "
                        f"(expected {DRAFT_ARCH}, {MLA_DRAFT_ARCHS[0]}, {SPECULATORS_ARCH} or a speculators config)")
    layer, where, unsupported = fmt.read_layer(cfg)
    mla = fmt.holds_mla and (any(a in MLA_DRAFT_ARCHS for a in archs) or bool(layer.get("kv_lora_rank")))
    layout = fmt.layer_prefix("mla" if mla else "gqa").rstrip(".")
    if layer.get("attention_bias") or layer.get("mlp_bias") or cfg.get("bias"):
        unsupported.append("linear biases")
    options = {k: bool(cfg.get(k)) for k in _OPTION_FLAGS}
    options["norm_before_fc"] |= bool(eagle.get("norm_before_fc"))
    options["fc_norm"] |= bool(cfg.get("use_aux_norm"))  # SGLang's legacy name
    hidden = int(_need(layer, "hidden_size", where))
    heads = int(_need(layer, "num_attention_heads", where))
    vocab = int(_need(layer, "vocab_size", where))
    draft_vocab = int(cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab)
    rope_theta, rope_scaling = _rope(layer)
    sizes: dict[str, int] = {}
    if mla:
        sizes = {k: int(layer.get(k) or 0) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                      "qk_rope_head_dim", "v_head_dim")}
        if not sizes["q_lora_rank"]:
            unsupported.append("MLA without q_lora_rank")
        rope_scaling = _plain_if_unit_yarn(rope_scaling)
        head_dim, kv_heads = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"], heads  # not config head_dim
    else:
        head_dim, kv_heads = int(layer.get("head_dim") or hidden // heads), int(layer.get("num_key_value_heads") or heads)
    window = _window(layer)
    if mla and window:
        unsupported.append("a sliding window on an MLA draft")
    top = _ids(cfg.get("eagle_aux_hidden_state_layer_ids"))
    written_eagle = _ids(eagle.get("eagle_aux_hidden_state_layer_ids"))
    aux, note, source = _aux_known(ours, fmt.source, top, written_eagle)
    record = as_target_record(ours.get("target")) if ours is not None else {}
    trained_for = record.get("name") or fmt.verifier(cfg)
    if trained_for is None:
        trained_for = cfg.get("target_model") or cfg.get("base_model") or _front_matter(readme, "base_model")
    config = Eagle3Config.unchecked(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(_need(layer, "intermediate_size", where)),
        rms_norm_eps=float(layer.get("rms_norm_eps") or 1e-6), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings") or 0), vocab_size=vocab,
        draft_vocab_size=draft_vocab, target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        aux_layer_ids=aux, hidden_act=str(layer.get("hidden_act") or "silu"), attention="mla" if mla else "gqa",
        **sizes, **options, sliding_window=window, **parallel_fields(cfg))
    return HeadSpec(
        source=source, layout=layout, architectures=archs, config=config,
        num_hidden_layers=int(layer.get("num_hidden_layers") or 1), written_top=top, written_eagle=written_eagle,
        aux_ids_note=note, trained_for=str(trained_for) if trained_for else None, target_record=record,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or layer.get("torch_dtype") or ""),
        quantization=_quant_name(cfg), unsupported=tuple(unsupported),
    )


def parallel_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """P-EAGLE settings a config states: ``parallel_drafting`` (ours), a speculators ``peagle``
    config, or a placeholder token alone (``mask_token_id``, or ``ptd_token_id`` of vLLM's PTD PR),
    which is all a plain vLLM draft folder holds (``parallel_drafting`` goes in --speculative-config)."""
    token = cfg.get("mask_token_id", cfg.get("ptd_token_id"))
    if not (cfg.get("parallel_drafting") or cfg.get("speculators_model_type") == "peagle" or token is not None):
        return {}
    return {"parallel_drafting": True, "mask_token_id": -1 if token is None else token}


def as_target_record(target: Any) -> dict[str, Any]:
    """The ``outrider.target`` record: a dict from export, a plain name from the trainer."""
    if isinstance(target, dict):
        return dict(target)
    return {"name": str(target)} if target else {}


def _front_matter(readme: str, key: str) -> str | None:
    """A scalar from a model card's YAML front matter (``key: value`` or a one-item list)."""
    if not readme.startswith("---"):
        return None
    end = readme.find("\n---", 3)
    lines = readme[3:end if end > 0 else len(readme)].splitlines()
    for i, line in enumerate(lines):
        m = re.match(rf"^{re.escape(key)}\s*:\s*(.*)$", line)
        if not m:
            continue
        value = m.group(1).strip().strip("'\"")
        if value:
            return value
        if i + 1 < len(lines) and lines[i + 1].strip().startswith("- "):
            return lines[i + 1].strip()[2:].strip().strip("'\"") or None
    return None


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        raise UserError(f"draft not found: {path} (give the folder that holds the head's config.json)")
    config = path / "config.json"
    if not config.exists():
        raise UserError(f"{path} has no config.json: not a draft checkpoint folder")
    return read_json(config)


def read_head_spec(path: str | Path) -> HeadSpec:
    """``HeadSpec`` of a draft folder (config.json, plus README.md front matter if present)."""
    path = Path(path).expanduser()
    cfg = read_config(path)
    readme = path / "README.md" if path.is_dir() else path.parent / "README.md"
    text = readme.read_text(errors="replace") if readme.exists() else ""
    return head_spec_from_config(cfg, text)


# --------------------------------------------------------------------------------------------
# Tensor names
# --------------------------------------------------------------------------------------------

def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Our tensor names and shapes (the ``Eagle3Head`` state dict)."""
    H, Ht, nh = cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads
    n_aux = len(cfg.aux_layer_ids)
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, n_aux * Ht)}
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (n_aux * Ht,)
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (Ht,) for i in range(n_aux)})
    attn = "midlayer.self_attn."
    if cfg.attention == "mla":
        rq, rkv, dn, dr, dv = (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                               cfg.v_head_dim)
        shapes.update({
            attn + "q_a_proj.weight": (rq, 2 * H), attn + "q_a_layernorm.weight": (rq,),
            attn + "q_b_proj.weight": (nh * (dn + dr), rq), attn + "kv_a_proj_with_mqa.weight": (rkv + dr, 2 * H),
            attn + "kv_a_layernorm.weight": (rkv,), attn + "kv_b_proj.weight": (nh * (dn + dv), rkv),
            attn + "o_proj.weight": (H, nh * dv)})
    else:
        q, kv = nh * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shapes.update({attn + "q_proj.weight": (q, 2 * H), attn + "k_proj.weight": (kv, 2 * H),
                       attn + "v_proj.weight": (kv, 2 * H), attn + "o_proj.weight": (H, q)})
    shapes.update({
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, H),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, H),
        "midlayer.mlp.down_proj.weight": (H, cfg.intermediate_size),
        "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
    })
    if cfg.parallel_drafting:  # P-EAGLE's placeholder aux state, vLLM's name and shape
        shapes["mask_hidden"] = (1, n_aux * Ht)
    return shapes


def format_names(cfg: Eagle3Config, fmt: str) -> set[str]:
    """The exact tensor names a checkpoint in ``fmt`` holds for this head."""
    return get_format(fmt).tensor_names(cfg, expected_shapes(cfg))


def to_format_state_dict(head: Eagle3Head, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under ``fmt``'s names; weights cast to ``dtype``, d2t int64, t2d bool."""
    out: dict[str, torch.Tensor] = {}
    keep = format_names(head.config, fmt)
    prefix = get_format(fmt).layer_prefix(head.config.attention)
    for name, tensor in head.state_dict().items():
        name = rename(name, OUR_LAYER, prefix)
        if name not in keep:
            continue
        t = tensor.detach().to("cpu")
        t = t.long() if name == "d2t" else t.bool() if name == "t2d" else t.to(dtype)
        if name == "mask_hidden":
            t = t.reshape((1,) * (get_format(fmt).mask_hidden_dims - 1) + (-1,))
        out[name] = t.contiguous()
    return out


def _to_our_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if state and all(k.startswith("model.") for k in state if k != "lm_head.weight"):
        state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    out = {}
    for k, v in state.items():
        k = rename(k, LAYERS0, OUR_LAYER)
        for legacy, new in _LEGACY.items():
            k = rename(k, legacy, new)
        if k not in _DROPPED_ON_IMPORT:
            out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def weight_source(path: Path) -> list[Path] | dict[str, torch.Tensor] | None:
    """Where a head folder's weights are: its safetensors files (one, or those its index names),
    the state dict of its ``pytorch_model.bin`` (``torch.load(weights_only=True)``), or None."""
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    weight_map = safetensors_index(path)
    if weight_map is not None:
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / "pytorch_model.bin").exists():
        try:
            state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError) as e:
            raise UserError(f"cannot read {path / 'pytorch_model.bin'}: {str(e).splitlines()[0]}") from None
        if not isinstance(state, dict):
            raise UserError(f"{path / 'pytorch_model.bin'} does not hold a state dict")
        return state
    return None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = weight_source(path)
    if files is None:
        raise UserError(f"{path} has no model.safetensors (or pytorch_model.bin): no head weights to load")
    if isinstance(files, dict):
        return files
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f, device="cpu"))
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {f}: {e} (the file is corrupt or truncated)") from None
    return state


def _target_dict(target_config: Any) -> dict[str, Any] | None:
    if target_config is None:
        return None
    if isinstance(target_config, dict):
        return target_config
    if isinstance(target_config, (str, Path)):
        return load_config_dict(target_config)
    return target_config.to_dict()


def check_against_target(cfg: Eagle3Config, target_config: Any) -> None:
    """``UserError`` unless the head fits the target: hidden size, vocabulary, aux ids."""
    info = arch_info(_target_dict(target_config))
    if cfg.target_hidden_size != info.hidden_size:
        raise UserError(f"the head expects target hidden size {cfg.target_hidden_size}, the target has "
                        f"{info.hidden_size}: this head was trained for another model")
    if cfg.draft_vocab_size > info.vocab_size:
        raise UserError(f"the head's draft vocabulary ({cfg.draft_vocab_size}) is larger than the target's "
                        f"vocabulary ({info.vocab_size}): this head was trained for another model")
    if cfg.vocab_size != info.vocab_size:
        raise UserError(f"the head was built for a vocabulary of {cfg.vocab_size}, the target has "
                        f"{info.vocab_size}: this head was trained for another model")
    bad = [j for j in cfg.aux_layer_ids if not 0 <= j <= info.num_layers]
    if bad:
        raise UserError(f"the head's aux layer ids {bad} are out of range: the target has {info.num_layers} "
                        f"layers (ids 0..{info.num_layers}, {info.num_layers} = the last layer's output)")


def load_head(path: str | Path, target_config: Any = None, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> tuple[Eagle3Head, Eagle3Config]:
    """Load an EAGLE-3 head from any supported checkpoint folder (a DFlash drafter's folder gives
    the drafter and its config, ``formats.dflash``); see the module docstring."""
    path = Path(path).expanduser()
    if (path / "config.json").is_file() and is_dflash(read_config(path)):
        drafter = read_dflash(path, _target_dict(target_config), dtype, device)
        return drafter, drafter.config
    spec = read_head_spec(path)
    target = _target_dict(target_config)
    if target is not None:
        if spec.config.draft_vocab_size > arch_info(target).vocab_size:
            raise UserError(f"the head's draft vocabulary ({spec.config.draft_vocab_size}) is larger than the target's "
                            f"vocabulary ({arch_info(target).vocab_size}): this head was trained for another model")
        info = arch_info(target)
        cfg = spec.eagle3_config(info.num_layers, info.model_type)
        check_against_target(cfg, target)
    else:
        cfg = spec.eagle3_config()
    if spec.num_hidden_layers != 1:
        raise UserError(f"the head has {spec.num_hidden_layers} decoder layers; outrider runs single-layer "
                        f"EAGLE-3 heads")
    state = _to_our_names(_read_tensors(path))
    files = weight_source(path)
    where = str(files[0]) if isinstance(files, list) and len(files) == 1 else str(path)
    shapes = expected_shapes(cfg)
    if "d2t" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise UserError(f"{path} has no d2t although its draft vocabulary ({cfg.draft_vocab_size}) is smaller "
                            f"than the vocabulary ({cfg.vocab_size}): the draft ids cannot be mapped")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        targets = torch.arange(cfg.draft_vocab_size) + state["d2t"].long()
        check_draft_map(state["d2t"], None, cfg.vocab_size, where)
        t2d[targets] = True
        state["t2d"] = t2d
    if "mask_hidden" in state:
        if cfg.parallel_drafting:  # vLLM reads any shape that flattens to [1, n_aux * H_t]
            state["mask_hidden"] = state["mask_hidden"].reshape(1, -1)
        else:  # vLLM skips it too (with a warning; ``inspect`` warns): an EAGLE-3 head
            del state["mask_hidden"]
    elif cfg.parallel_drafting:
        raise UserError(f"{path}: the config says parallel drafting (mask_token_id {cfg.mask_token_id}) but the "
                        "checkpoint has no mask_hidden tensor: not a servable P-EAGLE head (vLLM refuses it too)")
    unknown = sorted(set(state) - set(shapes))
    missing = sorted(set(shapes) - set(state))
    if unknown or missing:
        parts = [f"unknown tensors {unknown[:5]}"] if unknown else []
        parts += [f"missing tensors {missing[:5]}"] if missing else []
        raise UserError(f"{path}: {'; '.join(parts)}: not an EAGLE-3 head outrider can load")
    wrong = [f"{k} {tuple(state[k].shape)} != {shapes[k]}" for k in shapes if tuple(state[k].shape) != shapes[k]]
    if wrong:
        raise UserError(f"{path}: tensor shapes disagree with its config.json: {'; '.join(wrong[:3])}")
    check_draft_map(state["d2t"], state["t2d"], cfg.vocab_size, where)
    check_finite(state, where, "the head is damaged (a training run that diverged?): retrain it or take an earlier "
                 "checkpoint")
    head = _empty_head(cfg)
    d2t, t2d = state.pop("d2t").long(), state.pop("t2d").bool()
    state = {k: v.float() for k, v in state.items()}
    head.load_state_dict({**state, "d2t": d2t.clone(), "t2d": t2d.clone()}, strict=True, assign=True)
    head.set_vocab(d2t, t2d)  # validates the mapping
    return head.to(device=device, dtype=dtype).eval(), cfg


def _empty_head(cfg: Eagle3Config) -> Eagle3Head:
    """An ``Eagle3Head`` whose weights are not initialised (they are about to be assigned)."""
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    head.rotary = type(head.rotary)(cfg)  # rotary tables are computed, not loaded: build them for real
    return head
