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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from outrider import __version__
from outrider.errors import UserError
from outrider.fsutil import atomic_dir
from outrider.heads.checkpoint import (
    _DTYPES,
    DRAFT_ARCH,
    FORMATS,
    SPECULATORS_ARCH,
    _record,
    check_against_target,
    format_names,
    load_head,
    read_config,
    read_head_spec,
    to_format_state_dict,
)
from outrider.heads.eagle3 import AUX_IDS_SEMANTICS, Eagle3Config, Eagle3Head

_SGLANG_SHIFT_NOTE = ("SGLang adds 1 to explicit aux ids when the first id is 1 (always, before "
                      "sgl-project/sglang PR 25454)")


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
    from outrider.models import (
        arch_info,
        load_config_dict,
        resolve,
        target_name,
        tokenizer_fingerprint,
    )

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
