"""Writing a head in a registered format (``formats.FORMATS``): ``export`` and ``save_head``.

Contract:
- ``export(head_or_dir, format, out, target=None)`` writes ``out/`` atomically: ``config.json``
  (the format's writer), ``model.safetensors`` (the format's tensor names) and ``LAUNCH.md`` (the
  engine flags for this head); an earlier folder's output marker and lock are carried over
  (``outputs``). Before the new folder replaces ``out`` it is read back with ``load_head`` and the
  reloaded head's logits on random inputs must equal the in-memory head's: a head whose tensors
  SGLang would silently ignore never ships. Any missing or unknown tensor name fails the export.
- Aux ids: outrider's id ``j`` is the hidden state entering target layer ``j``; each format writes
  what its engines read (``written_aux_ids``), aux ids are written ascending
  (``ascending_aux_order``), and the ``outrider`` section records the true ids and their meaning.
- A format that ``carries_target`` (speculators) names its verifier by a path or hub id that
  resolves and carries the target's embedding, so it needs the target (``--target`` or the one the
  head records).
- ``save_head`` is our own checkpoint layout (the trainer's output): ``vllm`` in float32.

Not done here: the formats themselves (``formats.*``), reading (``checkpoint``); quantised heads,
multi-layer drafts, heads with attention biases. No network access: a target is a local folder, a
GGUF file or ``default``.
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
from outrider.fsutil import atomic_dir, safetensors_index
from outrider.interop.checkpoint import (
    as_target_record,
    check_against_target,
    format_names,
    load_head,
    read_config,
    read_head_spec,
    to_format_state_dict,
)
from outrider.heads.dflash import DFlashDrafter
from outrider.heads.eagle3 import AUX_IDS_SEMANTICS, Eagle3Config, Eagle3Head
from outrider.interop.engines import option_issues, serves_last_layer
from outrider.interop.formats import get_format
from outrider.interop.formats.base import AuxIds
from outrider.interop.formats.dflash import is_dflash, write_dflash
from outrider.interop.launch import launch_text
from outrider.trees import TreeSpec
from outrider.models import (
    arch_info,
    load_config_dict,
    resolve,
    target_name,
    tokenizer_fingerprint,
)
from outrider.outputs import OWN_FILES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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
    written_aux_layer_ids: list[int]  # top level: what vLLM reads
    written_eagle_aux_layer_ids: list[int] | None  # eagle_config: what SGLang reads (None: not written)
    max_abs_logit_diff: float  # reloaded vs in-memory head, random inputs
    launch: str  # LAUNCH.md text
    notes: list[str] = field(default_factory=list)
    drafter: str = "EAGLE-3"  # or "DFlash" (its ids written as DFlash's target_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """A few lines for the terminal: what was written, how it was checked, where the flags are."""
        nested = "" if self.written_eagle_aux_layer_ids is None else \
            f", eagle_config {self.written_eagle_aux_layer_ids} (SGLang)"
        read_as = "DFlash's target_layer_ids, vLLM" if self.drafter == "DFlash" else "vLLM"
        lines = [f"wrote a {self.format} {self.drafter} checkpoint to {self.out}: {self.num_tensors} tensors, "
                 f"{self.dtype}",
                 f"aux layer ids {self.aux_layer_ids}, written as {self.written_aux_layer_ids} ({read_as}){nested}",
                 f"reload check: max |logit difference| {self.max_abs_logit_diff:.3g} on random inputs",
                 *(f"note: {n}" for n in self.notes),
                 f"launch commands: {Path(self.out) / 'LAUNCH.md'}"]
        return "\n".join(lines)


def written_aux_ids(ids: Sequence[int], fmt: str, model_type: str | None = None) -> AuxIds:
    """(top-level ids for vLLM, ``eagle_config`` ids for SGLang or None, how SGLang reads them)."""
    return get_format(fmt).written_ids(tuple(int(j) for j in ids), model_type)


def _target_record(target: str | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the ``outrider.target`` record, the target's config dict) for a target spec."""
    if target is None:
        return {}, None

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


def _local_target(record: dict[str, Any]) -> str | None:
    """The recorded target as a spec that resolves on this machine (``default`` or a path), or None."""
    for key in ("name_or_path", "name"):
        spec = record.get(key)
        if not spec:
            continue
        try:
            resolve(spec)
        except UserError:
            continue
        return str(spec)
    return None


def _recorded_model_type(record: dict[str, Any]) -> str | None:
    if record.get("model_type"):
        return str(record["model_type"])
    spec = _local_target(record)
    if spec is None:
        return None

    return arch_info(load_config_dict(spec)).model_type


def _verifier(target: str | None, record: dict[str, Any]) -> str:
    """speculators' ``verifier.name_or_path``: the target's resolved path, or the recorded hub id."""
    spec = target or _local_target(record)
    if spec is not None:
        return str(resolve(spec))
    name = str(record.get("name_or_path") or record.get("name") or "")
    if "/" in name and not name.startswith(("/", ".", "~")):  # a hub id: speculators resolves it itself
        return name
    raise UserError("the speculators format names the verifier the head was trained for: pass --target "
                    "(a local folder or default)")


def _target_embedding(target: str, cfg: Eagle3Config) -> torch.Tensor:
    """The target's input embedding [vocab, H] from its safetensors, without loading the model."""
    from safetensors import SafetensorError, safe_open

    path = resolve(target)
    if not path.is_dir():
        raise UserError("embeddings can be copied only from a Hugging Face folder target, not a GGUF file")
    weight_map = safetensors_index(path)
    if weight_map is None and (path / "model.safetensors").exists():
        with safe_open(path / "model.safetensors", framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    if weight_map is None:
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


def ascending_aux_order(head: Eagle3Head) -> Eagle3Head:
    """The same head with its aux ids ascending (``fc`` column blocks, and the per-chunk
    ``fc_norm`` weights, permuted to match).

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
    if head.input_norm is not None:
        raise UserError(f"aux layer ids {list(ids)} are not ascending and norm_before_fc normalises their "
                        "concatenation as listed: the engines' layer order cannot be written for this head")
    out = copy.deepcopy(head)
    Ht = head.config.target_hidden_size
    blocks = head.fc.weight.detach().split(Ht, dim=1)  # 3 x [H, H_t], in the config's id order
    with torch.no_grad():
        out.fc.weight.copy_(torch.cat([blocks[i] for i in order], dim=1))
        if head.fc_norm is not None:
            for new, old in enumerate(order):
                out.fc_norm[new].weight.copy_(head.fc_norm[old].weight)
        if head.mask_hidden is not None:  # P-EAGLE's placeholder aux state: fc's input space, same blocks
            chunks = head.mask_hidden.detach().split(Ht, dim=1)  # 3 x [1, H_t]
            out.mask_hidden.copy_(torch.cat([chunks[i] for i in order], dim=1))
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
        if cfg.parallel_drafting:  # the placeholder positions: mask_hidden through fc, the mask token's place
            if (reloaded.config.parallel_drafting, reloaded.config.mask_token_id) != (True, cfg.mask_token_id):
                return float("inf")
            a = torch.cat([a, reference(emb, reference.placeholder(1, n)[1], pos)[0]], dim=1)
            b = torch.cat([b, reloaded(emb, reloaded.placeholder(1, n)[1], pos)[0]], dim=1)
        elif reloaded.config.parallel_drafting:
            return float("inf")
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
    meta["target"] = as_target_record(meta.get("target")) or as_target_record(spec.trained_for)
    return head, meta


def _options(cfg: Eagle3Config) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc",
                                         "sliding_window")}


def export(head_or_dir: Eagle3Head | str | Path, format: str, out: str | Path, target: str | None = None, *,
           dtype: str = "bfloat16", num_speculative_tokens: int | None = None, include_embeddings: bool = False,
           extra: dict[str, Any] | None = None, tree: TreeSpec | None = None) -> ExportReport:
    """Write a servable checkpoint of a head (in memory, or a checkpoint folder) in ``format``.

    ``target`` (a local model folder, GGUF file or ``default``) is checked against the head,
    recorded as the model the head was trained for and used in LAUNCH.md and for SGLang's aux-id
    rule. ``include_embeddings`` copies the target's input embedding into the checkpoint as
    ``embed_tokens.weight`` (SpecForge expects it; the engines share the target's); the
    ``speculators`` format always carries it. ``tree`` (``outrider.trees``) puts a draft tree's flags
    in LAUNCH.md instead of the chain of ``num_speculative_tokens``.
    """
    fmt = get_format(format)
    if isinstance(head_or_dir, DFlashDrafter) or (
            not isinstance(head_or_dir, Eagle3Head) and is_dflash(read_config(head_or_dir))):
        return _export_dflash(head_or_dir, format, out, target, dtype, num_speculative_tokens, extra, tree)
    num_speculative_tokens = 3 if num_speculative_tokens is None else num_speculative_tokens
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    record, target_cfg = _target_record(target)
    original, meta = _resolve_head(head_or_dir, target_cfg)
    head = ascending_aux_order(original)
    cfg = head.config
    if target_cfg is not None:
        check_against_target(cfg, target_cfg)
    elif meta.get("target"):
        record = dict(meta["target"])

    model_type = arch_info(target_cfg).model_type if target_cfg is not None else _recorded_model_type(record)
    num_layers = arch_info(target_cfg).num_layers if target_cfg is not None else record.get("num_layers")
    embedding_from = target
    verifier = None
    if fmt.carries_target:
        verifier = _verifier(target, record)
        embedding_from = target or _local_target(record)
        if embedding_from is None:
            raise UserError(f"the {format} format carries the target's embedding (speculators would run with "
                            "zeros without it): pass --target")
        include_embeddings = True
    elif include_embeddings and target is None:
        raise UserError("--include-embeddings needs the target (its embedding is copied into the checkpoint)")
    top, nested, nested_note = written_aux_ids(cfg.aux_layer_ids, format, model_type)
    fmt.check_ids(cfg.aux_layer_ids, num_layers)
    section = {k: v for k, v in meta.items() if k not in ("format", "version", "target")}
    section.update(extra or {})
    section.update({
        "format": format, "version": __version__,
        "aux_layer_ids": list(cfg.aux_layer_ids), "aux_layer_ids_semantics": AUX_IDS_SEMANTICS,
        "written_aux_layer_ids": list(top), "written_aux_layer_ids_read_as": "verbatim by vLLM: " + AUX_IDS_SEMANTICS,
        "target": record,
    })
    if nested is not None:
        section.update({"written_eagle_aux_layer_ids": list(nested), "written_eagle_aux_layer_ids_read_as": nested_note})
    config = fmt.config(cfg, torch_dtype, section, num_speculative_tokens, model_type, verifier)
    tensors = to_format_state_dict(head, format, torch_dtype)
    expected = format_names(cfg, format)
    if set(tensors) != expected:
        raise UserError(f"export would write tensors {sorted(set(tensors) ^ expected)[:5]} that the {format} "
                        f"format does not define: the head's state dict is not an EAGLE-3 head")
    if include_embeddings:
        tensors["embed_tokens.weight"] = _target_embedding(embedding_from, cfg).to(torch_dtype).contiguous()
    notes: list[str] = []
    if target_cfg is not None:
        tmax = arch_info(target_cfg).max_position_embeddings
        if tmax and cfg.max_position_embeddings < tmax:
            notes.append(f"the head's max_position_embeddings ({cfg.max_position_embeddings}) is below the "
                         f"target's ({tmax})")
    if head is not original:
        notes.append(f"aux ids {list(original.config.aux_layer_ids)} written in ascending order "
                     f"{list(cfg.aux_layer_ids)} (fc columns permuted): the engines capture them in layer order")
    if nested is not None and nested != top and not nested_note.startswith("unshifted"):
        notes.append(f"eagle_config ids written as {list(nested)} for SGLang's rule (outrider ids {list(top)})")
    notes += engine_notes(cfg, model_type, num_layers, nested_note)
    out = Path(out).expanduser().resolve()
    launch = launch_text(fmt, out, cfg, top, nested, nested_note, target, target_cfg, model_type,
                         num_speculative_tokens, tree=tree)
    reference = copy.deepcopy(original).to(device="cpu", dtype=torch_dtype).eval()
    from safetensors.torch import save_file

    with atomic_dir(out, carry=OWN_FILES) as tmp:
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
                        aux_layer_ids=list(cfg.aux_layer_ids), written_aux_layer_ids=list(top),
                        written_eagle_aux_layer_ids=None if nested is None else list(nested),
                        max_abs_logit_diff=diff, launch=launch, notes=notes)


def _export_dflash(drafter_or_dir: DFlashDrafter | str | Path, format: str, out: str | Path, target: str | None,
                   dtype: str, num_speculative_tokens: int | None, extra: dict[str, Any] | None,
                   tree: TreeSpec | None) -> ExportReport:
    """A DFlash drafter in vLLM's DFlash layout (``formats.dflash``) for ``vllm`` and ``sglang``, in
    speculators' for ``speculators``."""
    if tree is not None:
        raise UserError("a DFlash drafter drafts chains (one block per round): drop --tree")
    record, target_cfg = _target_record(target)
    drafter = drafter_or_dir if isinstance(drafter_or_dir, DFlashDrafter) else load_head(drafter_or_dir)[0]
    meta = {} if isinstance(drafter_or_dir, DFlashDrafter) else dict(read_config(drafter_or_dir).get("outrider") or {})
    meta.pop("config", None)
    if target is None and isinstance(meta.get("target"), dict):
        target = meta["target"].get("name")
    verifier = None
    if format == "speculators":
        record = record or dict(meta.get("target") or {})
        verifier = _verifier(target, record)
    cfg = drafter.config
    written = write_dflash(drafter, out, target, dtype, {**meta, **(extra or {})}, num_speculative_tokens, target_cfg,
                           layout="speculators" if format == "speculators" else "vllm", verifier=verifier,
                           verifier_archs=list(record.get("architectures") or []))
    k = num_speculative_tokens or cfg.max_draft
    notes = [] if k == cfg.max_draft else [
        f"num_speculative_tokens {k} {'exceeds' if k > cfg.max_draft else 'is below'} the trained block's "
        f"{cfg.max_draft} drafts: LAUNCH.md asks for {min(k, cfg.max_draft)}" + (
            "" if k > cfg.max_draft else " (a shorter block than trained: usually lower acceptance)")]
    return ExportReport(format=format, out=written["out"], files=written["files"], num_tensors=written["num_tensors"],
                        dtype=dtype, aux_layer_ids=list(cfg.aux_layer_ids), written_aux_layer_ids=cfg.target_layer_ids,
                        written_eagle_aux_layer_ids=None, max_abs_logit_diff=written["max_abs_logit_diff"],
                        launch=(Path(written["out"]) / "LAUNCH.md").read_text(), notes=notes, drafter="DFlash")


def engine_notes(cfg: Eagle3Config, model_type: str | None, num_layers: int | None, nested_note: str) -> list[str]:
    """What an engine will not serve of this head, or serves only under a condition."""
    notes = []
    for engine, label in (("vllm", "vLLM"), ("sglang", "SGLang")):
        blocking, caveats = option_issues(cfg.attention, _options(cfg), engine)
        if blocking:
            notes.append(f"{label} does not read {', '.join(blocking)}: it would serve this head wrongly")
        notes += [f"{label}: {c}" for c in caveats]
        if num_layers and max(cfg.aux_layer_ids) >= num_layers and not serves_last_layer(engine, model_type):
            notes.append(f"{label} cannot capture aux id {num_layers} (the last layer's output) on this target")
    if nested_note.startswith("unshifted"):
        notes.append(f"eagle_config ids {nested_note}")
    return notes


def save_head(head: Eagle3Head, out: str | Path, target: str | None = None,
              extra: dict[str, Any] | None = None) -> ExportReport:
    """outrider's own checkpoint layout: the vLLM format in float32 plus the ``outrider`` section."""
    return export(head, "vllm", out, target, dtype="float32", extra=extra)
