"""EAGLE-3 heads to and from the SGLang, vLLM and speculators checkpoint formats.

Contract:
- ``export(head_or_dir, format, out, target=None)`` writes ``out/`` atomically: ``config.json``,
  ``model.safetensors`` and ``LAUNCH.md`` (the engine flags for this head). Before the new
  directory replaces ``out`` it is read back with ``load_head`` and the reloaded head's logits
  on random inputs must equal the in-memory head's (same dtype, same ops): a head whose tensors
  SGLang would silently ignore never ships. Any missing or unknown tensor name fails the export.
- ``load_head(path, target_config=None)`` reads heads written by outrider, SpecForge and SGLang
  (``LlamaForCausalLMEagle3``, ``midlayer.*``), SafeAILab EAGLE-3 (same names, often
  ``pytorch_model.bin``) and speculators (``Eagle3Speculator``, ``layers.0.*``, nested
  ``transformer_layer_config``); an ``embed_tokens.weight`` is dropped (the target's is used), a
  missing ``d2t`` is the identity when the draft vocabulary is the whole vocabulary. Checked
  against ``target_config`` when given: hidden size, vocabulary, draft vocabulary, aux ids.
- ``read_head_spec(path)`` describes a head from its config.json alone (``inspect`` uses it).
- Our own checkpoint layout (``save_head``; the trainer's output) is the ``vllm`` format plus the
  ``outrider`` section, in float32.

Aux layer ids. outrider's id ``j`` is the hidden state entering target decoder layer ``j``
(Hugging Face ``output_hidden_states[j]``). vLLM reads ``eagle_aux_hidden_state_layer_ids`` at
the top level of the draft config verbatim with the same meaning (``get_eagle3_aux_layers_from_config``
in ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``; the target appends the state before
running layer ``j``) and falls back to ``(2, L//2, L-3)``. SGLang reads the ids from
``eagle_config`` and, since sgl-project/sglang PR 25454 (May 2026), adds 1 to them only when the
first id is 1 (earlier releases added 1 always); its fallback is ``(2, L//2, L-3)`` unshifted.
So the ``sglang`` format writes ``j - 1`` for every id when the first id is 2 (the default): the
first written id is 1 and SGLang old and new shift it back to ``j``. Other first ids are written
as they are (right for SGLang with PR 25454; LAUNCH.md says so); a first id of 1 cannot be
expressed for SGLang and is refused. The ``vllm`` and ``speculators`` formats write the ids
unchanged. Every format records the true ids and their meaning in the ``outrider`` section.
vLLM's speculators reader defaults ``norm_before_residual`` to true when it is absent, so it is
always written (false: the residual is the un-normalised hidden state).

Not done here: quantised heads, multi-layer drafts, heads whose attention has biases or whose
inputs are normalised before ``fc`` (``norm_before_fc``, ``fc_norm``): those are refused with a
``UserError``. No network access: a target is a local folder, a GGUF file or ``default``.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from outrider import __version__
from outrider.errors import UserError
from outrider.fsutil import atomic_dir
from outrider.head import AUX_IDS_SEMANTICS, Eagle3Config, Eagle3Head

FORMATS = ("sglang", "vllm", "speculators")
DRAFT_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
EAGLE3_ARCHS = (DRAFT_ARCH, "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle")

_LAYER_TENSORS = (
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
_OUR_LAYER = "midlayer."
_SPECULATORS_LAYER = "layers.0."
# Present in peers' checkpoints but not part of a head: the target's embedding (frozen, shared)
# and speculators' training-only copies of the verifier's head.
_DROPPED_ON_IMPORT = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SGLANG_SHIFT_NOTE = ("SGLang adds 1 to explicit aux ids when the first id is 1 (always, before "
                      "sgl-project/sglang PR 25454)")


# --------------------------------------------------------------------------------------------
# Reading a head's config.json
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadSpec:
    """What a draft's config.json says, in outrider's terms; needs no weights.

    ``written_top`` are the ids vLLM reads, ``written_eagle`` the ids SGLang reads (both as
    written); ``aux_layer_ids`` the ids in outrider's meaning when they can be known (``None``
    when the config names none: the engines then use ``(2, L//2, L-3)``).
    """

    source: str  # "outrider" | "speculators" | "eagle3" (SpecForge, SGLang, SafeAILab)
    layout: str  # tensor-name layout: "midlayer" | "layers.0"
    architectures: tuple[str, ...]
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    hidden_act: str
    num_hidden_layers: int
    written_top: tuple[int, ...] | None
    written_eagle: tuple[int, ...] | None
    aux_layer_ids: tuple[int, ...] | None
    aux_ids_note: str
    trained_for: str | None
    target_record: dict[str, Any]
    torch_dtype: str
    quantization: str
    unsupported: tuple[str, ...]  # variant features this head uses that outrider cannot run

    def eagle3_config(self, target_num_layers: int | None = None) -> Eagle3Config:
        """An ``Eagle3Config``; the engines' default aux ids need the target's layer count."""
        if self.unsupported:
            raise UserError(f"this EAGLE-3 head uses {', '.join(self.unsupported)}, which outrider does not support")
        ids = self.aux_layer_ids
        if ids is None:
            if target_num_layers is None:
                raise UserError("the head's config names no aux layer ids: pass the target so the engines' "
                                "default (2, L//2, L-3) can be used")
            L = target_num_layers
            ids = (2, L // 2, L - 3)
        return Eagle3Config(
            hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size, target_hidden_size=self.target_hidden_size,
            aux_layer_ids=ids, hidden_act=self.hidden_act)

    def vllm_reads(self, num_layers: int) -> tuple[int, ...]:
        """The layers vLLM captures for this draft (outrider meaning)."""
        if self.written_top:
            return self.written_top
        return (2, num_layers // 2, num_layers - 3)

    def sglang_reads(self, num_layers: int) -> tuple[int, ...]:
        """The layers SGLang (with PR 25454) captures for this draft (outrider meaning)."""
        ids = self.written_eagle or self.written_top
        if not ids:
            return (2, num_layers // 2, num_layers - 3)
        return tuple(j + 1 for j in ids) if ids[0] == 1 else ids

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    return float(cfg.get("rope_theta") or 10000.0), (dict(scaling) if isinstance(scaling, dict) else None)


def _quant_name(cfg: dict[str, Any]) -> str:
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant:
        return str(quant.get("quant_method") or quant.get("format") or "custom")
    return ""


def head_spec_from_config(cfg: dict[str, Any], readme: str = "") -> HeadSpec:
    """Describe a head from its config.json dict (and, optionally, its README's front matter)."""
    if not isinstance(cfg, dict):
        raise UserError("the head's config.json is not a JSON object")
    ours = cfg.get("outrider") if isinstance(cfg.get("outrider"), dict) else None
    speculators = cfg.get("speculators_model_type") is not None
    archs = tuple(cfg.get("architectures") or ())
    unsupported: list[str] = []
    if speculators:
        if cfg.get("speculators_model_type") != "eagle3":
            raise UserError(f"speculators model type '{cfg.get('speculators_model_type')}' is not an EAGLE-3 head")
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise UserError("speculators config has no 'transformer_layer_config': not an EAGLE-3 speculator")
        where, layout = "the speculators transformer_layer_config", "layers.0"
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if cfg.get(flag):
                unsupported.append(flag)
    else:
        looks_eagle3 = ours is not None or any(a in EAGLE3_ARCHS for a in archs) or "draft_vocab_size" in cfg \
            or isinstance(cfg.get("eagle_config"), dict)
        if not looks_eagle3:
            raise UserError(f"config architectures {list(archs)} do not describe an EAGLE-3 head "
                            f"(expected {DRAFT_ARCH}, {SPECULATORS_ARCH} or a speculators config)")
        layer, where, layout = cfg, "the head's config.json", "midlayer"
        if cfg.get("fc_norm") or cfg.get("norm_before_fc"):
            unsupported.append("fc_norm" if cfg.get("fc_norm") else "norm_before_fc")
    if cfg.get("norm_before_residual"):
        unsupported.append("norm_before_residual")
    if layer.get("attention_bias") or layer.get("mlp_bias") or cfg.get("bias"):
        unsupported.append("linear biases")
    hidden = int(_need(layer, "hidden_size", where))
    heads = int(_need(layer, "num_attention_heads", where))
    vocab = int(_need(layer, "vocab_size", where))
    draft_vocab = int(cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab)
    rope_theta, rope_scaling = _rope(layer)
    top = _ids(cfg.get("eagle_aux_hidden_state_layer_ids"))
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    written_eagle = _ids(eagle.get("eagle_aux_hidden_state_layer_ids"))
    recorded = None
    if ours is not None:  # export writes aux_layer_ids; the trainer writes them inside head_config
        head_config = ours.get("head_config") if isinstance(ours.get("head_config"), dict) else {}
        recorded = ours.get("aux_layer_ids", head_config.get("aux_layer_ids"))
        semantics = ours.get("aux_layer_ids_semantics") or head_config.get("aux_layer_ids_semantics")
        if recorded is not None and semantics not in (None, AUX_IDS_SEMANTICS):
            raise UserError(f"the head records aux ids as '{semantics}', outrider expects '{AUX_IDS_SEMANTICS}'")
    if recorded is not None:
        aux, note, source = _ids(recorded), "recorded by outrider", "outrider"
    elif speculators:
        aux, note, source = top, "speculators ids (read as vLLM reads them)", "speculators"
    else:
        source = "eagle3"
        written = written_eagle or top
        if written is None:
            aux, note = None, "none in the config: the engines use (2, L//2, L-3)"
        elif written[0] == 1:
            aux = tuple(j + 1 for j in written)
            note = (f"ids {list(written)} start at 1: read as SGLang reads them (+1, sgl-project/sglang PR 25454); "
                    f"vLLM would read them unshifted")
        else:
            aux, note = written, "as written"
    record = _record(ours.get("target")) if ours is not None else {}
    trained_for = record.get("name") or None
    if trained_for is None and speculators:
        verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
        trained_for = verifier.get("name_or_path") or None
    if trained_for is None:
        trained_for = cfg.get("target_model") or cfg.get("base_model") or _front_matter(readme, "base_model")
    return HeadSpec(
        source=source, layout=layout, architectures=archs, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(_need(layer, "intermediate_size", where)),
        rms_norm_eps=float(layer.get("rms_norm_eps") or 1e-6), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings") or 0), vocab_size=vocab,
        draft_vocab_size=draft_vocab, target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        hidden_act=str(layer.get("hidden_act") or "silu"), num_hidden_layers=int(layer.get("num_hidden_layers") or 1),
        written_top=top, written_eagle=written_eagle, aux_layer_ids=aux, aux_ids_note=note,
        trained_for=str(trained_for) if trained_for else None, target_record=record,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or layer.get("torch_dtype") or ""),
        quantization=_quant_name(cfg), unsupported=tuple(unsupported),
    )


def _record(target: Any) -> dict[str, Any]:
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
    try:
        return json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {config}: {e}") from None


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
    H, Ht, d = cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {
        "fc.weight": (H, 3 * Ht),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H), "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H), "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, H),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, H),
        "midlayer.mlp.down_proj.weight": (H, cfg.intermediate_size),
        "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
    }


def _rename(name: str, src: str, dst: str) -> str:
    return dst + name[len(src):] if name.startswith(src) else name


def format_names(cfg: Eagle3Config, fmt: str) -> set[str]:
    """The exact tensor names a checkpoint in ``fmt`` holds for this head."""
    names = set(expected_shapes(cfg))
    if fmt == "speculators":
        names = {_rename(n, _OUR_LAYER, _SPECULATORS_LAYER) for n in names}
        if cfg.draft_vocab_size == cfg.vocab_size:  # speculators registers no vocab buffers then
            names -= {"d2t", "t2d"}
    return names


def to_format_state_dict(head: Eagle3Head, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under ``fmt``'s names; weights cast to ``dtype``, d2t int64, t2d bool."""
    out: dict[str, torch.Tensor] = {}
    keep = format_names(head.config, fmt)
    for name, tensor in head.state_dict().items():
        if fmt == "speculators":
            name = _rename(name, _OUR_LAYER, _SPECULATORS_LAYER)
        if name not in keep:
            continue
        t = tensor.detach().to("cpu")
        t = t.long() if name == "d2t" else t.bool() if name == "t2d" else t.to(dtype)
        out[name] = t.contiguous()
    return out


def _to_our_names(state: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    if state and all(k.startswith("model.") for k in state if k != "lm_head.weight"):
        state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    if layout == "layers.0":
        state = {_rename(k, _SPECULATORS_LAYER, _OUR_LAYER): v for k, v in state.items()}
    return {k: v for k, v in state.items() if k not in _DROPPED_ON_IMPORT}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    elif index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {index}: {e}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
    elif (path / "pytorch_model.bin").exists():
        try:
            state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError) as e:
            raise UserError(f"cannot read {path / 'pytorch_model.bin'}: {str(e).splitlines()[0]}") from None
        if not isinstance(state, dict):
            raise UserError(f"{path / 'pytorch_model.bin'} does not hold a state dict")
        return state
    else:
        raise UserError(f"{path} has no model.safetensors (or pytorch_model.bin): no head weights to load")
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
        from outrider.models import load_config_dict

        return load_config_dict(target_config)
    return target_config.to_dict()


def check_against_target(cfg: Eagle3Config, target_config: Any) -> None:
    """``UserError`` unless the head fits the target: hidden size, vocabulary, aux ids."""
    from outrider.models import arch_info

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
    bad = [j for j in cfg.aux_layer_ids if not 0 <= j < info.num_layers]
    if bad:
        raise UserError(f"the head's aux layer ids {bad} are out of range: the target has {info.num_layers} "
                        f"layers (ids 0..{info.num_layers - 1})")


def load_head(path: str | Path, target_config: Any = None, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> tuple[Eagle3Head, Eagle3Config]:
    """Load an EAGLE-3 head from any supported checkpoint folder; see the module docstring."""
    path = Path(path).expanduser()
    spec = read_head_spec(path)
    target = _target_dict(target_config)
    if target is not None:
        from outrider.models import arch_info

        if spec.draft_vocab_size > arch_info(target).vocab_size:
            raise UserError(f"the head's draft vocabulary ({spec.draft_vocab_size}) is larger than the target's "
                            f"vocabulary ({arch_info(target).vocab_size}): this head was trained for another model")
        cfg = spec.eagle3_config(arch_info(target).num_layers)
        check_against_target(cfg, target)
    else:
        cfg = spec.eagle3_config()
    if spec.num_hidden_layers != 1:
        raise UserError(f"the head has {spec.num_hidden_layers} decoder layers; outrider runs single-layer "
                        f"EAGLE-3 heads")
    state = _to_our_names(_read_tensors(path), spec.layout)
    shapes = expected_shapes(cfg)
    if "d2t" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise UserError(f"{path} has no d2t although its draft vocabulary ({cfg.draft_vocab_size}) is smaller "
                            f"than the vocabulary ({cfg.vocab_size}): the draft ids cannot be mapped")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        targets = torch.arange(cfg.draft_vocab_size) + state["d2t"].long()
        if int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size:
            raise UserError(f"{path}: d2t maps draft ids outside the vocabulary of {cfg.vocab_size}")
        t2d[targets] = True
        state["t2d"] = t2d
    unknown = sorted(set(state) - set(shapes))
    missing = sorted(set(shapes) - set(state))
    if unknown or missing:
        parts = [f"unknown tensors {unknown[:5]}"] if unknown else []
        parts += [f"missing tensors {missing[:5]}"] if missing else []
        raise UserError(f"{path}: {'; '.join(parts)}: not an EAGLE-3 head outrider can load")
    wrong = [f"{k} {tuple(state[k].shape)} != {shapes[k]}" for k in shapes if tuple(state[k].shape) != shapes[k]]
    if wrong:
        raise UserError(f"{path}: tensor shapes disagree with its config.json: {'; '.join(wrong[:3])}")
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


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

@dataclass
class ExportReport:
    """What ``export`` wrote and how it checked it."""

    format: str
    out: str
    files: list[str]
    num_tensors: int
    dtype: str
    aux_layer_ids: list[int]  # outrider meaning
    written_aux_layer_ids: list[int]  # what the config says
    max_abs_logit_diff: float  # reloaded vs in-memory head, random inputs
    launch: str  # LAUNCH.md text
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """A few lines for the terminal: what was written, how it was checked, where the flags are."""
        lines = [f"wrote a {self.format} EAGLE-3 checkpoint to {self.out}: {self.num_tensors} tensors, {self.dtype}",
                 f"aux layer ids {self.aux_layer_ids}, written as {self.written_aux_layer_ids}",
                 f"reload check: max |logit difference| {self.max_abs_logit_diff:.3g} on random inputs",
                 *(f"note: {n}" for n in self.notes),
                 f"launch commands: {Path(self.out) / 'LAUNCH.md'}"]
        return "\n".join(lines)


def written_aux_ids(ids: Sequence[int], fmt: str) -> tuple[tuple[int, ...], str]:
    """The ids to write for ``fmt`` and how that engine reads them back (see module docstring)."""
    ids = tuple(int(j) for j in ids)
    if fmt != "sglang":
        return ids, "read verbatim by vLLM: " + AUX_IDS_SEMANTICS
    if ids[0] == 2:
        return tuple(j - 1 for j in ids), f"outrider id minus 1; {_SGLANG_SHIFT_NOTE}, giving the outrider ids back"
    if ids[0] == 1:
        raise UserError(f"aux layer ids {list(ids)} start at 1, which SGLang reads as 2 (sgl-project/sglang PR 25454): "
                        f"export with --format vllm, or train with the default ids (2, L//2, L-3)")
    return ids, "verbatim; needs an SGLang release with PR 25454 (older releases add 1 to every id)"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rope_fields(cfg: Eagle3Config) -> dict[str, Any]:
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    if scaling is not None:
        scaling.setdefault("type", scaling["rope_type"])  # the pre-transformers-4.45 key some readers still use
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling}


def _llama_fields(cfg: Eagle3Config) -> dict[str, Any]:
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        **_rope_fields(cfg), "max_position_embeddings": cfg.max_position_embeddings, "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "pretraining_tp": 1,
    }


def config_dict(cfg: Eagle3Config, fmt: str, dtype: torch.dtype, outrider: dict[str, Any],
                num_speculative_tokens: int = 3) -> dict[str, Any]:
    """config.json for ``fmt`` (the ``outrider`` section is passed in and stored as is)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format '{fmt}': use one of {', '.join(FORMATS)}")
    ids, _ = written_aux_ids(cfg.aux_layer_ids, fmt)
    if fmt == "speculators":
        layer = _llama_fields(cfg)
        layer["rope_parameters"] = cfg.rope_parameters()
        target = outrider.get("target") or {}
        return {
            "architectures": [SPECULATORS_ARCH],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target.get("name_or_path"),
                             "architectures": list(target.get("architectures") or [])},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(ids),
            "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "embed_requires_grad": False,
            "torch_dtype": _dtype_name(dtype),
            "outrider": outrider,
        }
    return {
        "architectures": [DRAFT_ARCH],
        **_llama_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(ids)},
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "torch_dtype": _dtype_name(dtype),
        "outrider": outrider,
    }


def _target_record(target: str | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the ``outrider.target`` record, the target's config dict) for a target spec."""
    if target is None:
        return {}, None
    from outrider.compat import target_name, tokenizer_fingerprint
    from outrider.models import arch_info, load_config_dict, resolve

    path = resolve(target)
    tcfg = load_config_dict(target)
    info = arch_info(tcfg)
    record: dict[str, Any] = {
        "name": target_name(path, tcfg), "name_or_path": str(target) if str(target) == "default" else str(path),
        "model_type": info.model_type, "architectures": list(info.architectures), "num_layers": info.num_layers,
        "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
    }
    fingerprint = tokenizer_fingerprint(path) if path.is_dir() else {}
    if fingerprint.get("vocab_sha256"):
        record["tokenizer"] = fingerprint
    return record, tcfg


def _target_embedding(target: str, cfg: Eagle3Config) -> torch.Tensor:
    """The target's input embedding [vocab, H] from its safetensors, without loading the model."""
    from safetensors import SafetensorError, safe_open

    from outrider.models import resolve

    path = resolve(target)
    if not path.is_dir():
        raise UserError("embeddings can be copied only from a Hugging Face folder target, not a GGUF file")
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (path / "model.safetensors").exists():
        with safe_open(path / "model.safetensors", framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise UserError(f"{path} has no safetensors weights: cannot copy the target's embedding into the export")
    keys = sorted(k for k in weight_map if k.endswith("embed_tokens.weight") and "mtp" not in k)
    if not keys:
        raise UserError(f"{path} has no '*embed_tokens.weight' tensor: cannot copy the target's embedding")
    key = min(keys, key=len)
    try:
        with safe_open(path / weight_map[key], framework="pt") as f:
            emb = f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path / weight_map[key]}: {e}") from None
    if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise UserError(f"the target's embedding has shape {tuple(emb.shape)}, the head needs "
                        f"({cfg.vocab_size}, {cfg.hidden_size})")
    return emb


def launch_text(fmt: str, out: Path, cfg: Eagle3Config, written: Sequence[int], written_note: str,
                target: str | None, target_cfg: dict[str, Any] | None, k: int = 3) -> str:
    """LAUNCH.md: the engine command lines for this head and what to watch out for."""
    from outrider.models import arch_info

    tgt = str(target) if target and str(target) != "default" else "<target model>"
    info = arch_info(target_cfg) if target_cfg is not None else None
    remote = bool(target_cfg and (target_cfg.get("auto_map") or str(info.model_type).startswith("kimi")))
    trc = " --trust-remote-code" if remote else ""
    spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": k}
    mla_spec = dict(spec, attention_backend="FLASH_ATTN")
    lines = [f"# Serving this EAGLE-3 head ({fmt} format)", "",
             f"Aux layer ids (outrider meaning: {AUX_IDS_SEMANTICS}): {list(cfg.aux_layer_ids)}; "
             f"written in config.json as {list(written)} ({written_note}).", ""]
    if fmt in ("vllm", "speculators"):
        lines += ["## vLLM", "", "```bash",
                  f"vllm serve {tgt}{trc} \\", f"  --speculative-config '{json.dumps(spec)}'", "```", "",
                  "- vLLM reads `eagle_aux_hidden_state_layer_ids` at the top level of config.json as written "
                  "(id j = the state entering layer j) and defaults to (2, L//2, L-3) without it.",
                  "- MLA targets (DeepSeek-V3, Kimi-K2/K2.5): the draft is a plain GQA Llama layer. If the draft "
                  "fails to start on an MLA-only attention backend, give it its own backend (vLLM PR 39930):",
                  "", "```bash", f"  --speculative-config '{json.dumps(mla_spec)}'", "```", ""]
        if fmt == "speculators":
            lines += ["- speculators format: vLLM maps `Eagle3Speculator` to its EAGLE-3 Llama draft; "
                      "`speculators_config.verifier.name_or_path` names the target it was trained for.", ""]
    sglang_cmd = ["```bash", f"python -m sglang.launch_server --model-path {tgt}{trc} \\",
                  "  --speculative-algorithm EAGLE3 \\", f"  --speculative-draft-model-path {out} \\",
                  f"  --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
                  "```", ""]
    if fmt == "sglang":
        lines += ["## SGLang", "", *sglang_cmd,
                  f"- SGLang reads the ids in `eagle_config`; {_SGLANG_SHIFT_NOTE}. The ids above are written so "
                  "that SGLang captures the layers the head was trained on.",
                  "- Do not hand this folder to vLLM: it reads the same ids without the shift. Export with "
                  "`--format vllm` for vLLM.", ""]
    elif fmt == "vllm" and written[0] != 1:
        lines += ["## SGLang (releases with sgl-project/sglang PR 25454, May 2026, or later)", "", *sglang_cmd,
                  f"- {_SGLANG_SHIFT_NOTE}: these ids do not start at 1, so a current SGLang reads them unshifted. "
                  "For an older SGLang export with `--format sglang`.", ""]
    if info is not None and info.is_moe:
        lines += [f"- MoE target ({info.num_experts} experts, {info.experts_per_token} per token): every verified "
                  "token wakes more experts, so keep chains (top-k 1) and few draft tokens.", ""]
    return "\n".join(lines)


def ascending_aux_order(head: Eagle3Head) -> Eagle3Head:
    """The same head with its aux ids ascending (``fc`` column blocks permuted to match).

    vLLM and SGLang append the aux states inside the target's layer loop, so they hand the
    draft its states in ascending layer order whatever order the config lists; each layer is
    captured once, so repeated ids cannot be served.
    """
    ids = head.config.aux_layer_ids
    if len(set(ids)) != len(ids):
        raise UserError(f"aux layer ids {list(ids)} repeat a layer: the engines capture each layer once, so this "
                        f"head cannot be served (train it on three distinct layers)")
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    if order == list(range(len(ids))):
        return head
    out = copy.deepcopy(head)
    Ht = head.config.target_hidden_size
    blocks = head.fc.weight.detach().split(Ht, dim=1)  # 3 x [H, H_t], in the config's id order
    with torch.no_grad():
        out.fc.weight.copy_(torch.cat([blocks[i] for i in order], dim=1))
    out.config = replace(head.config, aux_layer_ids=tuple(ids[i] for i in order))
    return out


def _random_check(reference: Eagle3Head, reloaded: Eagle3Head, seed: int = 0, n: int = 8) -> float:
    """Max |logit difference| of two heads on the same random target states and embeddings."""
    cfg = reference.config
    dtype = next(reference.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    states = {j: torch.randn(1, n, cfg.target_hidden_size, generator=gen).to(dtype)  # [1, n, H_t] per layer
              for j in sorted(set(cfg.aux_layer_ids) | set(reloaded.config.aux_layer_ids))}
    emb = torch.randn(1, n, cfg.hidden_size, generator=gen).to(dtype)  # [1, n, H]
    pos = torch.arange(n)[None]  # [1, n]
    with torch.no_grad():
        aux_a = torch.cat([states[j] for j in cfg.aux_layer_ids], dim=-1)  # [1, n, 3*H_t]
        aux_b = torch.cat([states[j] for j in reloaded.config.aux_layer_ids], dim=-1)
        a, _ = reference(emb, reference.fuse(aux_a), pos)
        b, _ = reloaded(emb, reloaded.fuse(aux_b), pos)
    if not torch.equal(reference.d2t, reloaded.d2t) or not torch.equal(reference.t2d, reloaded.t2d):
        return float("inf")
    return float((a.float() - b.float()).abs().max())


def _resolve_head(head_or_dir: Eagle3Head | str | Path, target_cfg: dict[str, Any] | None
                  ) -> tuple[Eagle3Head, dict[str, Any]]:
    if isinstance(head_or_dir, Eagle3Head):
        return head_or_dir, {}
    path = Path(head_or_dir).expanduser()
    spec = read_head_spec(path)
    head, _ = load_head(path, target_cfg)
    meta = dict(read_config(path).get("outrider") or {})
    meta["target"] = _record(meta.get("target")) or _record(spec.trained_for)
    return head, meta


def export(head_or_dir: Eagle3Head | str | Path, format: str, out: str | Path, target: str | None = None, *,
           dtype: str = "bfloat16", num_speculative_tokens: int = 3, include_embeddings: bool = False,
           extra: dict[str, Any] | None = None) -> ExportReport:
    """Write a servable checkpoint of a head (in memory, or a checkpoint folder) in ``format``.

    ``target`` (a local model folder, GGUF file or ``default``) is checked against the head,
    recorded as the model the head was trained for and used in LAUNCH.md.
    ``include_embeddings`` copies the target's input embedding into the checkpoint as
    ``embed_tokens.weight`` (peers such as SpecForge expect it; the engines share the target's).
    """
    if format not in FORMATS:
        raise UserError(f"unknown export format '{format}': use one of {', '.join(FORMATS)}")
    if dtype not in _DTYPES:
        raise UserError(f"unknown dtype '{dtype}': use one of {', '.join(_DTYPES)}")
    torch_dtype = _DTYPES[dtype]
    record, target_cfg = _target_record(target)
    original, meta = _resolve_head(head_or_dir, target_cfg)
    head = ascending_aux_order(original)
    cfg = head.config
    if target_cfg is not None:
        check_against_target(cfg, target_cfg)
    elif meta.get("target"):
        record = dict(meta["target"])
    if include_embeddings and target is None:
        raise UserError("--include-embeddings needs the target (its embedding is copied into the checkpoint)")
    written, written_note = written_aux_ids(cfg.aux_layer_ids, format)
    section = {k: v for k, v in meta.items() if k not in ("format", "version", "target")}
    section.update(extra or {})
    section.update({
        "format": format, "version": __version__,
        "aux_layer_ids": list(cfg.aux_layer_ids), "aux_layer_ids_semantics": AUX_IDS_SEMANTICS,
        "written_aux_layer_ids": list(written), "written_aux_layer_ids_read_as": written_note,
        "target": record,
    })
    config = config_dict(cfg, format, torch_dtype, section, num_speculative_tokens)
    tensors = to_format_state_dict(head, format, torch_dtype)
    expected = format_names(cfg, format)
    if set(tensors) != expected:
        raise UserError(f"export would write tensors {sorted(set(tensors) ^ expected)[:5]} that the {format} "
                        f"format does not define: the head's state dict is not an EAGLE-3 head")
    if include_embeddings:
        tensors["embed_tokens.weight"] = _target_embedding(target, cfg).to(torch_dtype).contiguous()
    notes: list[str] = []
    if target_cfg is not None:
        from outrider.models import arch_info

        tmax = arch_info(target_cfg).max_position_embeddings
        if tmax and cfg.max_position_embeddings < tmax:
            notes.append(f"the head's max_position_embeddings ({cfg.max_position_embeddings}) is below the "
                         f"target's ({tmax})")
    if head is not original:
        notes.append(f"aux ids {list(original.config.aux_layer_ids)} written in ascending order "
                     f"{list(cfg.aux_layer_ids)} (fc columns permuted): the engines capture them in layer order")
    if format == "sglang" and written != cfg.aux_layer_ids:
        notes.append(f"aux ids written as {list(written)} for SGLang's +1 shift "
                     f"(outrider ids {list(cfg.aux_layer_ids)})")
    out = Path(out).expanduser().resolve()
    launch = launch_text(format, out, cfg, written, written_note, target, target_cfg, num_speculative_tokens)
    reference = copy.deepcopy(original).to(device="cpu", dtype=torch_dtype).eval()
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "LAUNCH.md").write_text(launch)
        reloaded, _ = load_head(tmp, target_cfg, dtype=torch_dtype)
        diff = _random_check(reference, reloaded)
        tol = 1e-5 if torch_dtype == torch.float32 else 1e-2
        if not diff <= tol:
            raise UserError(f"the written {format} checkpoint does not reproduce the head (max logit difference "
                            f"{diff:.3g}): nothing was written to {out}")
        files = sorted(p.name for p in tmp.iterdir())
    return ExportReport(format=format, out=str(out), files=files, num_tensors=len(tensors), dtype=dtype,
                        aux_layer_ids=list(cfg.aux_layer_ids), written_aux_layer_ids=list(written),
                        max_abs_logit_diff=diff, launch=launch, notes=notes)


def save_head(head: Eagle3Head, out: str | Path, target: str | None = None,
              extra: dict[str, Any] | None = None) -> ExportReport:
    """outrider's own checkpoint layout: the vLLM format in float32 plus the ``outrider`` section."""
    return export(head, "vllm", out, target, dtype="float32", extra=extra)
