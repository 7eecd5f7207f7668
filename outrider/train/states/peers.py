"""Hidden-state caches written by other trainers, read for ``outrider train --cache``.

Contract: ``open_peer(folder)`` detects the format from the files and returns a reader with the
interface of ``outrider.train.states.cache.OutriderCache`` (``kind``, ``path``, ``hidden_size``,
``aux_layer_ids`` = None (neither format records them), ``final_prenorm``, ``tokenizer`` = None,
``splits()`` = ``["train"]``, ``examples(split)``, ``read(split, index) -> Stored``), or refuses
with one line. Nothing read here runs code: pickles load with ``torch.load(weights_only=True)``.

- **SpecForge** (``scripts/prepare_hidden_states.py``, 0.2.0): one ``torch.save`` dict per example,
  ``rows_{g}-{g+G}/data_{i}.ckpt`` (or ``.ckpt.gz``, gzip around the same bytes), with
  ``input_ids`` [N] int64, ``loss_mask`` [N] int64, ``aux_hidden_state`` [1, N, 3H] (the aux
  states concatenated; SpecForge's layer id ``i`` is the output of layer ``i``, our id ``i+1``:
  its default ``[1, L//2-1, L-4]`` is our ``(2, L//2, L-3)``) and ``hidden_state`` [1, N, H]
  (after the final norm). Examples are ordered by ``i``. Its writer right-pads each record to
  the longest row of its batch with token 0 and mask 0, and the true length is not stored:
  positions after the last loss-masked token, which no training loss reads, are dropped.
  Records of other algorithms (DFlash's ``hidden_states`` alone) are refused.
- **speculators / vLLM** (0.9.0; vLLM's ``ExampleHiddenStatesConnector``): ``hidden_states/hs_{i}.safetensors``
  with ``hidden_states`` [T, k, H] (the aux states, then the last one, id ``L``, **before** the
  final norm: training applies the target's norm) and ``token_ids`` [T] int64, next to the Arrow
  dataset (``save_to_disk``: ``state.json``, ``data-*.arrow``) whose row ``i`` holds
  ``input_ids`` and ``loss_mask``. ``k`` must be 4 (three aux states and the last). The fp8 layout
  of **hs-connectors** (``FP8HiddenStatesConnector``) stores ``float8_e4m3fn`` values with
  ``hidden_states_scales`` [T, 1, 1] float32 (one scale per token for all k states); they are
  dequantised as its ``FP8Transfer`` does, ``q.to(bf16) * scale.to(bf16)``. Given the folder of
  the Arrow dataset or its ``hidden_states/``. A row without its file, or whose ``token_ids``
  differ from the dataset's, is refused.

Not done here: caches from Mooncake (no files), SpecForge's other algorithms, a validation split
(these caches are all training examples).
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from outrider.errors import UserError
from outrider.train.states.cache import Stored, teacher_rows
from outrider.train.data.datasets import require_pyarrow
from outrider.values import check_finite

_NONFINITE = "the peer's capture produced them (its target or dtype): capture that example again"

_SPECFORGE = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
_SPECULATORS = re.compile(r"^hs_(\d+)\.safetensors$")


def open_peer(path: Path) -> Any:
    specforge = [(int(m.group(1)), p) for p in path.rglob("data_*.ckpt*") if (m := _SPECFORGE.match(p.name))]
    if specforge:
        return SpecForgeCache(path, sorted(specforge))
    hs_dir = path / "hidden_states" if (path / "hidden_states").is_dir() else path
    if any(_SPECULATORS.match(p.name) for p in hs_dir.glob("hs_*.safetensors")):
        data = hs_dir.parent if hs_dir == path else path
        return SpeculatorsCache(data, hs_dir)
    raise UserError(f"{path} is not a hidden-state cache outrider reads: expected the header.json of `outrider "
                    "capture`, SpecForge's rows_*/data_*.ckpt[.gz] or speculators' hidden_states/hs_*.safetensors")


class SpecForgeCache:
    """SpecForge's per-example files (EAGLE-3 records)."""

    kind = "SpecForge"
    final_prenorm = False  # SpecForge's hidden_state is after the final norm
    aux_layer_ids = None
    tokenizer = None

    def __init__(self, path: Path, files: list[tuple[int, Path]]):
        self.path = path
        self.files = [p for _, p in files]
        self.lengths: list[int] = []
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.hidden_size = 0
        for p in self.files:
            rec = self._load(p)
            ids, mask = rec["input_ids"].reshape(-1), rec["loss_mask"].reshape(-1)
            learned = np.flatnonzero(mask.numpy() != 0)
            n = int(learned[-1]) + 1 if learned.size else int(ids.numel())  # the writer's zero padding dropped
            self.lengths.append(n)
            self.ids.append(ids[:n].numpy().astype(np.int32))
            self.masks.append(mask[:n].numpy().astype(np.int8))
            self.hidden_size = self.hidden_size or int(rec["hidden_state"].shape[-1])

    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        try:
            if path.name.endswith(".gz"):
                with gzip.open(path, "rb") as f:
                    rec = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
            else:
                rec = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
            raise UserError(f"cannot read the SpecForge file {path} as tensors only (weights_only): "
                            f"{' '.join(str(e).split())[:160]}") from None
        need = ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state")
        if not isinstance(rec, dict) or any(k not in rec or not torch.is_tensor(rec[k]) for k in need):
            keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise UserError(f"the SpecForge file {path} holds {keys}, not an EAGLE-3 record ({', '.join(need)}): "
                            "capture it with SpecForge for EAGLE-3")
        N, H = rec["input_ids"].numel(), rec["hidden_state"].shape[-1]
        if rec["aux_hidden_state"].shape[-2:] != (N, 3 * H) or rec["hidden_state"].shape[-2] != N \
                or rec["loss_mask"].numel() != N:
            raise UserError(f"the SpecForge file {path} has shapes that disagree (input_ids {N}, aux "
                            f"{tuple(rec['aux_hidden_state'].shape)}, hidden_state {tuple(rec['hidden_state'].shape)})")
        return rec

    def splits(self) -> list[str]:
        return ["train"]

    def examples(self, split: str) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
        return self.ids, self.masks, [p.name for p in self.files]

    def read(self, split: str, index: int) -> Stored:
        rec = self._load(self.files[index])
        n, H = self.lengths[index], self.hidden_size
        rows = torch.from_numpy(teacher_rows(self.masks[index]))
        aux = rec["aux_hidden_state"].reshape(-1, 3, H)[:n]  # [n, 3, H]
        final = rec["hidden_state"].reshape(-1, H).index_select(0, rows)  # [M, H]
        check_finite({"aux_hidden_state": aux, "hidden_state": final}, str(self.files[index]), _NONFINITE)
        return Stored(aux, None, final, None, rows)


class SpeculatorsCache:
    """speculators' Arrow dataset and vLLM's ``hs_{i}.safetensors`` (plain or hs-connectors fp8)."""

    kind = "speculators"
    final_prenorm = True  # vLLM's last captured state (id L) comes before the final norm
    aux_layer_ids = None
    tokenizer = None

    def __init__(self, data: Path, hs_dir: Path):
        from safetensors import SafetensorError, safe_open

        self.path = hs_dir
        self.ids, self.masks = _arrow_rows(data, hs_dir)
        self.files = [hs_dir / f"hs_{i}.safetensors" for i in range(len(self.ids))]
        self.hidden_size = 0
        for i, p in enumerate(self.files):
            if not p.exists():
                raise UserError(f"{p} is missing: the speculators dataset {data} has {len(self.ids)} rows; generate "
                                "the missing hidden states first")
            try:
                with safe_open(str(p), framework="pt") as f:
                    shape = f.get_slice("hidden_states").get_shape()
                    tokens = f.get_tensor("token_ids")
            except (SafetensorError, OSError) as e:
                raise UserError(f"cannot read {p}: {e}") from None
            if len(shape) != 3 or shape[1] != 4:
                raise UserError(f"{p} holds hidden_states of shape {shape}: outrider reads [T, 4, H] (three aux states "
                                "and the last one; capture with the last layer included)")
            if not np.array_equal(tokens.numpy(), self.ids[i]):
                raise UserError(f"{p} holds other tokens than row {i} of the dataset {data}: the files and the "
                                "dataset do not belong together")
            self.hidden_size = self.hidden_size or int(shape[2])

    def splits(self) -> list[str]:
        return ["train"]

    def examples(self, split: str) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
        return self.ids, self.masks, [p.name for p in self.files]

    def read(self, split: str, index: int) -> Stored:
        hs, _ = read_connector_file(self.files[index])  # [T, 4, H]
        rows = torch.from_numpy(teacher_rows(self.masks[index]))
        return Stored(hs[:, :3], None, hs[:, 3].index_select(0, rows), None, rows)


def read_connector_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(``hidden_states`` [T, k, H], ``token_ids`` [T]) of one file of vLLM's hidden-states
    connector (plain, or hs-connectors' fp8 with ``hidden_states_scales``, dequantised as its
    ``FP8Transfer`` does); a file that is unreadable, cut short or non-finite is one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read the hidden states {path}: {str(e).splitlines()[0]}") from None
    if "hidden_states" not in t or "token_ids" not in t or t["hidden_states"].dim() != 3:
        raise UserError(f"{path} is not a hidden-states file of vLLM's connector (hidden_states [T, k, H], token_ids)")
    hs = t["hidden_states"]
    if "hidden_states_scales" in t:
        hs = hs.to(torch.bfloat16) * t["hidden_states_scales"].to(torch.bfloat16)
    check_finite({"hidden_states": hs}, str(path), _NONFINITE)
    return hs, t["token_ids"]


def _arrow_rows(data: Path, hs_dir: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``input_ids`` and ``loss_mask`` of a dataset written by ``datasets``' ``save_to_disk``."""
    pa, _ = require_pyarrow()
    state = data / "state.json"
    if not state.exists():
        raise UserError(f"{hs_dir} holds speculators hidden states, but {data} has no Arrow dataset (state.json) with "
                        "their loss masks: give the folder `speculators prepare-data` wrote")
    try:
        files = [data / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowInvalid) as e:
        raise UserError(f"cannot read the Arrow dataset {data}: {e}") from None
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for table in tables:
        if "input_ids" not in table.column_names or "loss_mask" not in table.column_names:
            raise UserError(f"the Arrow dataset {data} has no input_ids/loss_mask columns")
        ids += [np.asarray(x, dtype=np.int32) for x in table.column("input_ids").to_pylist()]
        masks += [np.asarray(x, dtype=np.int8) for x in table.column("loss_mask").to_pylist()]
    for i, (a, m) in enumerate(zip(ids, masks)):
        if len(a) != len(m):
            raise UserError(f"row {i} of the Arrow dataset {data} has {len(a)} tokens and {len(m)} loss-mask values")
    return ids, masks
