"""A checkpoint's safetensors, memory-mapped, and the recipes that turn them into one module's weights.

Contract:
- ``SafetensorsFiles(folder)`` opens a Hugging Face folder's weights: the shards listed by
  ``model.safetensors.index.json``, or the folder's ``*.safetensors`` files. Every header is read
  and checked up front; a missing shard, a shard shorter than its header says (truncated), a
  malformed header or an index naming a tensor its shard lacks is a one-line ``UserError``, so a
  long streamed capture never fails halfway on a bad file. ``tensor(name)`` is a zero-copy CPU
  view of the memory-mapped bytes (a private mapping: nothing is ever written back).
- ``module_recipes(files, module, module_name, prefix, keep_fp32)`` says, for every key of
  ``module.state_dict()`` (parameters and persistent buffers), which checkpoint tensors make it
  and how (``Recipe``): a tensor of the same name (``plain``), a compressed-tensors INT4 linear
  (``int4``: ``<mod>.weight_packed`` / ``weight_scale`` / ``weight_shape`` [/ ``weight_zero_point``]),
  or transformers 5's fused experts (``experts``: ``mlp.experts.gate_up_proj`` [E, 2I, H] from the
  checkpoint's per-expert ``experts.{e}.gate_proj`` and ``up_proj`` stacked and concatenated,
  ``down_proj`` [E, H, I] from ``experts.{e}.down_proj``: transformers' ``qwen2_moe`` conversion,
  used for DeepSeek-V3 and Kimi), each part plain or INT4. Keys are matched after the checkpoint's
  prefix (``model.``, Kimi-K2.5's ``language_model.model.``, ...): ``decoder_prefix`` finds it.
- A key's dtype is the skeleton's, or float32 where the model's ``_keep_in_fp32_modules_strict``
  (and for float16 ``_keep_in_fp32_modules``) patterns match, as transformers' loader decides.
- ``build_tensor(recipe, get)`` makes the module tensor on the device the raw tensors are on;
  ``get(name)`` returns a raw tensor and ``get_stacked(names)`` (optional) a zero-copy
  [E, ...] view of equally shaped raw tensors stored at a constant stride. INT4 parts are
  dequantized in groups of experts whose int32 unpacking temporary stays under ``temp_bytes``
  (the other temporaries of a group add about as much again).

Not done here: other tensor renamings (Mixtral's ``w1/w2/w3``, gpt-oss biases), FP8 block scales,
``.bin`` checkpoints (pickles are never loaded), writing.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from outrider.errors import UserError
from outrider.fsutil import SAFETENSORS_INDEX, safetensors_index
from outrider.train.states.int4 import (
    PACKED,
    SCALE,
    SHAPE,
    ZERO,
    dequant_int4,
    unpack_int4_rows,
)

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
DECODER_PREFIXES = ("model.", "language_model.model.", "model.language_model.", "")


@dataclass(frozen=True)
class Entry:
    file: int  # index into SafetensorsFiles.paths
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFiles:
    """The safetensors of one checkpoint folder: headers checked, data memory-mapped on demand."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        listed = safetensors_index(folder)
        if listed is not None:
            names = sorted(set(listed.values()))
        else:
            names = sorted(p.name for p in folder.glob("*.safetensors"))
        if not names:
            raise UserError(f"{folder} has no .safetensors weights: layer streaming reads safetensors checkpoints "
                            "(convert .bin or GGUF weights with save_pretrained first)")
        self.folder, self.paths = folder, [folder / n for n in names]
        self.entries: dict[str, Entry] = {}
        for i, path in enumerate(self.paths):
            for name, entry in _read_header(path, i).items():
                self.entries.setdefault(name, entry)
        for name, shard in (listed or {}).items():
            entry = self.entries.get(name)
            if entry is None or self.paths[entry.file].name != shard:
                raise UserError(f"{SAFETENSORS_INDEX} lists '{name}' in {shard}, which does not hold it: the checkpoint "
                                "is incomplete or mixes two downloads")
        self._maps: dict[int, mmap.mmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self):
        return self.entries.keys()

    def nbytes(self, name: str) -> int:
        return self.entries[name].nbytes

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy CPU view of ``name`` (its pages are read when first touched)."""
        e = self.entries[name]
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        if e.file not in self._maps:
            with open(self.paths[e.file], "rb") as f:
                self._maps[e.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._maps[e.file], dtype=torch.uint8, count=e.nbytes, offset=e.begin)
        return flat.view(e.dtype).view(e.shape)

    def raw_bytes(self, name: str) -> torch.Tensor:
        """The bytes of ``name`` as a uint8 CPU view [nbytes]."""
        return self.tensor(name).reshape(-1).view(torch.uint8)

    def close(self) -> None:
        self._maps.clear()  # the mappings close once no tensor views them


def _read_header(path: Path, file_index: int) -> dict[str, Entry]:
    if not path.exists():
        raise UserError(f"checkpoint shard {path} is missing: download it again (the index lists it)")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint shard {path} is corrupt or truncated ({e}): download it again") from None
    out: dict[str, Entry] = {}
    base, needed = 8 + n, 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            entry = Entry(file_index, DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"]), base + begin,
                          base + end)
        except (KeyError, TypeError, ValueError):
            raise UserError(f"checkpoint shard {path} has a malformed entry for '{name}' (dtype "
                            f"{info.get('dtype') if isinstance(info, dict) else '?'}): cannot stream it") from None
        if entry.nbytes != math.prod(entry.shape) * entry.dtype.itemsize:
            raise UserError(f"checkpoint shard {path}: '{name}' has {entry.nbytes} bytes for shape {list(entry.shape)}")
        needed = max(needed, entry.end)
        out[name] = entry
    if needed > size:
        raise UserError(f"checkpoint shard {path} is truncated ({size} bytes, its header needs {needed}): "
                        "download it again")
    return out


def decoder_prefix(files: SafetensorsFiles) -> str:
    """The checkpoint's name prefix of the decoder (what precedes ``embed_tokens.weight``)."""
    for prefix in DECODER_PREFIXES:
        if prefix + "embed_tokens.weight" in files:
            return prefix
    raise UserError(f"the checkpoint in {files.folder} has no embed_tokens.weight under any of the prefixes "
                    f"{[p for p in DECODER_PREFIXES if p]}: not a decoder outrider can stream")


# --------------------------------------------------------------------------------------------
# Recipes


@dataclass(frozen=True)
class Part:
    """One projection of an ``experts`` recipe, or the single weight of a plain/int4 recipe:
    ``names[e]`` the checkpoint tensors for expert e (plain: ``(weight,)``; int4: ``(packed,
    scale)`` or ``(packed, scale, zero point)``)."""

    names: tuple[tuple[str, ...], ...]
    rows: int
    cols: int
    int4: bool


@dataclass(frozen=True)
class Recipe:
    key: str  # the module's state_dict key
    kind: str  # "plain" | "int4" | "experts"
    parts: tuple[Part, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]

    def sources(self) -> list[str]:
        """Checkpoint tensors this key reads, grouped so equal ones sit side by side (stackable)."""
        out: list[str] = []
        for part in self.parts:
            for slot in range(len(part.names[0])):
                out.extend(names[slot] for names in part.names)
        return out

    @property
    def dense_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def keep_fp32_pattern(model: torch.nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """The names transformers' loader keeps in float32 for a model loaded in ``dtype``."""
    keep: set[str] = set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return re.compile("|".join(k.replace("*", ".*") for k in sorted(keep))) if keep else None


def module_recipes(files: SafetensorsFiles, module: torch.nn.Module, module_name: str, prefix: str,
                   keep_fp32: re.Pattern | None = None) -> list[Recipe]:
    """Recipes for every state_dict key of ``module`` (named ``module_name`` in the model; its
    checkpoint names are ``prefix + key``)."""
    persistent = set(module.state_dict().keys())
    transient = [n for n, _ in module.named_buffers() if n not in persistent]
    if transient:
        raise UserError(f"{module_name} has non-persistent buffers {transient}: layer streaming cannot rebuild it")
    out = []
    for key, t in module.state_dict(keep_vars=True).items():
        full = f"{module_name}.{key}"
        dtype = torch.float32 if keep_fp32 is not None and keep_fp32.search(full) and t.is_floating_point() else t.dtype
        out.append(_recipe(files, prefix, key, tuple(t.shape), dtype, full))
    return out


def _linear_part(files: SafetensorsFiles, mod: str) -> Part | None:
    """``mod``'s weight, plain (``mod.weight``) or INT4 (``mod.weight_packed``...), or None."""
    if f"{mod}.weight" in files:
        rows, cols = files.entries[f"{mod}.weight"].shape[-2:]
        return Part(((f"{mod}.weight",),), rows, cols, False)
    if f"{mod}.{PACKED}" in files:
        names = [f"{mod}.{PACKED}", f"{mod}.{SCALE}"] + ([f"{mod}.{ZERO}"] if f"{mod}.{ZERO}" in files else [])
        rows = files.entries[names[0]].shape[0]
        shape = f"{mod}.{SHAPE}"
        cols = int(files.tensor(shape)[-1]) if shape in files else files.entries[names[0]].shape[1] * 8
        return Part((tuple(names),), rows, cols, True)
    return None


def _recipe(files: SafetensorsFiles, prefix: str, key: str, shape: tuple[int, ...], dtype: torch.dtype,
            full: str) -> Recipe:
    name = prefix + key
    if name in files:
        if files.entries[name].shape != shape:
            raise UserError(f"checkpoint tensor '{name}' has shape {list(files.entries[name].shape)}, the config "
                            f"makes {full} {list(shape)}: the checkpoint does not match its config.json")
        return Recipe(key, "plain", (Part(((name,),), 0, 0, False),), dtype, shape)
    if key.endswith(".weight"):
        part = _linear_part(files, name[: -len(".weight")])
        if part is not None:
            if (part.rows, part.cols) != shape:
                raise UserError(f"checkpoint tensor '{name}' is [{part.rows}, {part.cols}], the config makes {full} "
                                f"{list(shape)}: the checkpoint does not match its config.json")
            return Recipe(key, "int4" if part.int4 else "plain", (part,), dtype, shape)
    head, _, last = key.rpartition(".")
    if head.endswith("experts") and last in EXPERT_PARTS and len(shape) == 3:
        parts = []
        for proj in EXPERT_PARTS[last]:
            per_expert = [_linear_part(files, f"{prefix}{head}.{e}.{proj}") for e in range(shape[0])]
            if any(p is None for p in per_expert) or len({(p.rows, p.cols, p.int4) for p in per_expert}) != 1:
                break
            first = per_expert[0]
            parts.append(Part(tuple(p.names[0] for p in per_expert), first.rows, first.cols, first.int4))
        else:
            if sum(p.rows for p in parts) == shape[1] and all(p.cols == shape[2] for p in parts):
                return Recipe(key, "experts", tuple(parts), dtype, shape)
    raise UserError(f"the checkpoint has no tensor for {full} (looked for '{name}' and its quantized or per-expert "
                    "forms): it does not match its config.json, or names its weights in a way streaming cannot map")


# --------------------------------------------------------------------------------------------
# Building the module's tensors from raw ones


def build_tensor(recipe: Recipe, get: Callable[[str], torch.Tensor],
                 get_stacked: Callable[[Sequence[str]], torch.Tensor | None] | None = None,
                 temp_bytes: int = 1 << 30) -> torch.Tensor:
    """The module tensor of ``recipe`` on the raw tensors' device, in ``recipe.dtype``."""
    if recipe.kind == "plain":
        raw = get(recipe.parts[0].names[0][0])
        return raw if raw.dtype == recipe.dtype else raw.to(recipe.dtype)
    if recipe.kind == "int4":
        return _dequant_part(recipe.parts[0], 0, 1, get, get_stacked, recipe.dtype)[0]
    first = get(recipe.parts[0].names[0][0])
    out = torch.empty(recipe.shape, dtype=recipe.dtype, device=first.device)  # [E, rows, cols]
    experts, row = recipe.shape[0], 0
    for part in recipe.parts:
        per_expert = part.rows * part.cols * 4 if part.int4 else 0  # the int32 unpacking temporary
        group = max(1, min(experts, temp_bytes // max(per_expert, 1))) if part.int4 else experts
        for start in range(0, experts, group):
            stop = min(experts, start + group)
            if part.int4:
                w = _dequant_part(part, start, stop, get, get_stacked, recipe.dtype)  # [k, rows, cols]
            else:
                w = _stack([names[0] for names in part.names[start:stop]], get, get_stacked)
            out[start:stop, row: row + part.rows].copy_(w)
        row += part.rows
    return out


def _stack(names: Sequence[str], get, get_stacked) -> torch.Tensor:
    stacked = get_stacked(names) if get_stacked is not None else None
    return stacked if stacked is not None else torch.stack([get(n) for n in names])


def _dequant_part(part: Part, start: int, stop: int, get, get_stacked, dtype: torch.dtype) -> torch.Tensor:
    """Experts ``start:stop`` of an INT4 part, dequantized: [stop-start, rows, cols] in ``dtype``."""
    rows = part.names[start:stop]
    packed = _stack([r[0] for r in rows], get, get_stacked)  # [k, rows, cols/8] int32
    scale = _stack([r[1] for r in rows], get, get_stacked)  # [k, rows, cols/G]
    zero = None
    if len(rows[0]) > 2:
        zero = torch.stack([unpack_int4_rows(get(r[2]), part.rows) for r in rows])  # [k, rows, cols/G]
    return dequant_int4(packed, scale, part.cols, zero, dtype)
