"""The hidden-state cache: what a head's training reads from the target, written once, read many times.

Contract. A cache is a folder (``outrider capture`` writes it, ``outrider.train.states.cache_capture``):
- ``header.json``: ``format`` ``outrider-hidden-cache``, ``version`` 1, ``target`` (name,
  model type, hidden size, layers, vocabulary, ``config_sha256`` of its config.json,
  ``weights_sha256`` of its final norm and first embedding rows, the tokenizer identity of the
  token dataset it was captured from), ``aux_layer_ids`` with ``aux_semantics`` (id ``j`` = the
  hidden state entering decoder layer ``j`` = Hugging Face ``output_hidden_states[j]``), the
  ``final`` state's meaning, ``dtype`` (``bf16``, ``fp8`` or ``float32``) and ``scaling``, the
  source data (path, manifest sha256, split sizes), the shard plan (``max_tokens_per_shard``,
  ``shards``).
- ``shard-NNNNN.safetensors``: the examples of a shard, concatenated along the token axis:
  ``input_ids`` int32 [N], ``loss_mask`` uint8 [N], ``aux`` [N, n_aux, H] (the aux states at
  every position), ``final`` [M, H] (the last decoder state after the final norm at the
  *teacher rows* only: positions ``t`` whose next token is learned, ``loss_mask[t+1] = 1``,
  the only rows the training-time-test loss reads, ``outrider.train.loop.ttt``); with ``fp8`` the
  values are ``float8_e4m3fn`` and ``aux_scale`` [N, n_aux, H/block], ``final_scale`` [M, H/block]
  float32 hold one scale per ``block`` values (``block = H``: one per token row and state):
  ``x ~= q * scale``, ``scale = max|x| / 448`` over the block.
- ``manifest.json``: the finished shards, each with its file name, size, ``sha256``,
  ``tokens_sha256`` (of its ``input_ids`` and ``loss_mask`` bytes), token and teacher-row counts
  and, column by column, its examples: split, index in the split, id, length, first token row,
  first teacher row, and the byte offsets of its first ``aux`` and ``final`` rows in the file.
  ``complete`` turns true when every planned shard is there.
Shards are written to a temporary name, fsynced and renamed; the manifest is rewritten after
each one (in a data-parallel capture every rank writes its own shards, rank 0 alone the header
and the manifest: ``CacheWriter(lead=False)`` and ``add``). A finished shard is never rewritten. Readers verify each shard's size when the cache
opens, the token checksum when they read its tokens and the whole file's sha256 the first time
they read its states; a mismatch is a one-line ``UserError``.

Not done here: running the target (``outrider.train.states.capture``), the capture loop
(``outrider.train.states.cache_capture``), turning stored states into a training batch
(``outrider.train.states.features``), the caches of other trainers (``outrider.train.states.peers``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from outrider.errors import UserError
from outrider.fsutil import atomic_path, atomic_write_json, atomic_write_text, read_text
from outrider.values import check_ids, nonfinite

FORMAT = "outrider-hidden-cache"
VERSION = 1
HEADER = "header.json"
MANIFEST = "manifest.json"
AUX_SEMANTICS = ("id j = the hidden state entering decoder layer j = Hugging Face output_hidden_states[j] "
                 "(0 = the embeddings)")
FINAL_SEMANTICS = ("the last decoder state after the final norm, at the teacher rows only: positions t whose "
                   "next token is learned (loss_mask[t+1] = 1)")
TOPK_SEMANTICS = ("at the teacher rows, the target's k largest logits over its whole vocabulary (teacher_ids, "
                  "teacher_logits) and the logsumexp of all its logits (teacher_lse), instead of the final state; "
                  "training keeps those k and spreads the remaining probability evenly over the other tokens")
DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
TOPK_ROWS = 256  # teacher rows whose full-vocabulary logits a top-k capture holds at once
SHARD_BYTES = 1 << 30  # the default shard size, in bytes of stored states


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def teacher_rows(loss_mask: np.ndarray) -> np.ndarray:
    """Positions ``t`` whose next token is learned (``loss_mask[t+1] = 1``): the rows of the
    teacher the TTT loss reads at some unroll step. loss_mask: [len] -> [M] int64."""
    return np.flatnonzero(np.asarray(loss_mask)[1:] != 0).astype(np.int64)


# --------------------------------------------------------------------------------------------
# Values: float8 with one scale per block


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (q [..., H] float8_e4m3fn, scale [..., H/block] float32), ``x ~= q * scale``."""
    H = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], H // block, block)  # [..., nb, block]
    scale = (blocks.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)  # [..., nb]
    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn).reshape(x.shape)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored values [..., H] (and scales [..., H/block] for float8) -> ``dtype``."""
    if scale is None:
        return q.to(dtype)
    nb = scale.shape[-1]
    blocks = q.float().reshape(*q.shape[:-1], nb, q.shape[-1] // nb)
    return (blocks * scale[..., None]).reshape(q.shape).to(dtype)


@dataclass
class Stored:
    """One example's states as a cache holds them (host tensors)."""

    aux: torch.Tensor  # [len, n_aux, H] stored dtype
    aux_scale: torch.Tensor | None  # [len, n_aux, H/block] float32 (float8 only)
    final: torch.Tensor | None  # [M, H] stored dtype: the final states at ``rows`` (None: a top-k teacher)
    final_scale: torch.Tensor | None  # [M, H/block] float32 (float8 only)
    rows: torch.Tensor  # [M] int64 positions of the teacher rows
    teacher_ids: torch.Tensor | None = None  # [M, K] int32: the target's K most likely next tokens
    teacher_logits: torch.Tensor | None = None  # [M, K] their logits (bf16; float32 in a float32 cache)
    teacher_lse: torch.Tensor | None = None  # [M] float32: logsumexp of all the target's logits

    def host(self) -> "Stored":
        """The same, every tensor on the CPU."""
        return Stored(**{k: v if v is None else v.cpu() for k, v in vars(self).items()})


def encode(aux: torch.Tensor, final: torch.Tensor, loss_mask: np.ndarray, n_aux: int, dtype: str,
           block: int, teacher: Any = None, topk: int = 0) -> Stored:
    """A source's states of one example -> what the cache stores (on the states' device).

    aux: [len, n_aux*H]; final: [len, H] after the final norm; loss_mask: [len]. With ``topk`` K > 0
    the teacher rows keep, instead of the final state, the target's K largest logits over its whole
    vocabulary (``teacher``: the full lm_head, a ``TeacherHead``) and the logsumexp of all of them."""
    rows = torch.from_numpy(teacher_rows(loss_mask))
    aux = aux.reshape(aux.shape[0], n_aux, -1)  # [len, n_aux, H]
    final = final.index_select(0, rows.to(final.device))  # [M, H]
    qa, sa = quantize(aux, block) if dtype == "fp8" else (aux.to(DTYPES[dtype]), None)
    if topk:
        parts = []
        for chunk in final.split(TOPK_ROWS):  # [<= TOPK_ROWS, H]: a few rows of full-vocabulary logits at a time
            logits = teacher(chunk.to(teacher.weight.dtype)).float()  # [rows, vocab]
            values, ids = logits.topk(min(topk, logits.shape[-1]), dim=-1)  # [rows, K]
            parts.append((ids, values, torch.logsumexp(logits, -1)))
        ids, values, lse = (torch.cat(p) for p in zip(*parts))  # split() yields one chunk even for no rows
        values = values.to(torch.float32 if dtype == "float32" else torch.bfloat16)
        return Stored(qa, sa, None, None, rows, ids.to(torch.int32), values, lse)
    if dtype == "fp8":
        qf, sf = quantize(final, block)
        return Stored(qa, sa, qf, sf, rows)
    return Stored(qa, None, final.to(DTYPES[dtype]), None, rows)


def topk_teacher(ids: torch.Tensor, values: torch.Tensor, lse: torch.Tensor, draft_index: torch.Tensor,
                 vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Teacher logits over the draft vocabulary from a top-k record.

    ids, values: [M, K] (target ids, their logits); lse: [M] logsumexp over the target's vocabulary;
    draft_index: [vocab] int64, a target id's place in the draft vocabulary or -1. The K tokens keep
    their logits; the rest share the remaining probability evenly (each ``lse + log(rest / (vocab - K))``),
    so that a softmax over the draft vocabulary is the target's, its tail flattened. -> [M, draft_vocab]."""
    M, K = ids.shape
    draft_vocab = int((draft_index >= 0).sum())
    values = values.float()
    if K < vocab_size:
        rest = (1.0 - torch.exp(values - lse[:, None]).sum(-1)).clamp_min(1e-12)  # [M] the tail's mass
        tail = lse + torch.log(rest / (vocab_size - K))  # [M]
    else:
        tail = torch.full_like(lse, -1e4)  # no tail: every token is among the K
    out = tail[:, None].expand(M, draft_vocab).clone()  # [M, draft_vocab]
    place = draft_index[ids.long()]  # [M, K] -1 where the token is not drafted
    keep = place >= 0
    out[torch.nonzero(keep, as_tuple=True)[0], place[keep]] = values[keep]
    return out.to(dtype)


# --------------------------------------------------------------------------------------------
# Header and manifest


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(read_text(path))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read the {what} {path}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object: not an outrider cache {what}")
    return data


def read_header(directory: Path) -> dict[str, Any]:
    header = read_json(directory / HEADER, "header")
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise UserError(f"{directory / HEADER} is not an {FORMAT} v{VERSION} header: capture again with "
                        "`outrider capture`")
    return header


def settings(header: dict[str, Any]) -> dict[str, Any]:
    """What a resumed capture must share with the cache it continues."""
    keys = ("target", "aux_layer_ids", "dtype", "scaling", "data", "max_tokens_per_shard", "shards")
    return {**{k: header.get(k) for k in keys}, "teacher": header.get("teacher") or {"kind": "final"}}


def _tensor_offsets(blob: bytes) -> dict[str, int]:
    """Byte offset in a safetensors file of each tensor's data."""
    (n,) = struct.unpack("<Q", blob[:8])
    meta = json.loads(blob[8:8 + n])
    return {k: 8 + n + v["data_offsets"][0] for k, v in meta.items() if k != "__metadata__"}


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the one place shard bytes reach the disk)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class Example:
    """One example ready for a shard: its place in the data and its stored states."""

    split: str
    index: int
    id: str
    input_ids: np.ndarray  # [len] int
    loss_mask: np.ndarray  # [len] 0/1
    stored: Stored


class CacheWriter:
    """Writes a cache folder shard by shard; resumes one written with the same settings.

    ``lead=False`` (the other ranks of a data-parallel capture, ``outrider.train.states.capture_ranks``):
    shard files only; the lead, constructed first, has written the header, removed a killed run's
    temporaries and adopted its shards, and lists the others' shards through ``add``."""

    def __init__(self, out: str | Path, header: dict[str, Any], lead: bool = True):
        self.out = Path(out).expanduser()
        self.header = header
        self.lead = lead
        self._lock = threading.Lock()  # the lead's writer thread and ``add`` both update the manifest
        if not lead:
            self.shards: dict[int, dict[str, Any]] = {}
            return
        if (self.out / HEADER).exists():
            have = read_header(self.out)
            if settings(have) != settings(header):
                diff = [k for k, v in settings(header).items() if settings(have).get(k) != v]
                raise UserError(f"{self.out} holds a capture with other settings ({', '.join(diff)} differ): "
                                "rerun with the same target, data and flags to finish it, or choose a new --out")
        elif self.out.exists() and any(p for p in self.out.iterdir() if not p.name.startswith(".")):
            raise UserError(f"{self.out} exists and is not an outrider cache: choose a new --out")
        else:
            atomic_write_json(self.out / HEADER, header)
        for stale in self.out.glob(".shard-*.tmp"):  # a killed capture's unfinished shard
            stale.unlink()
        self.shards = self._finished()

    def _finished(self) -> dict[int, dict[str, Any]]:
        """Shards in the manifest whose files are whole, and shards renamed into place by a capture
        killed before it could list them (adopted: they are complete by construction)."""
        manifest = read_json(self.out / MANIFEST, "manifest") if (self.out / MANIFEST).exists() else {}
        shards = {}
        for entry in manifest.get("shards", []):
            path = self.out / entry["file"]
            if path.exists() and path.stat().st_size == entry["bytes"]:
                shards[int(entry["index"])] = entry
        for path in sorted(self.out.glob("shard-*.safetensors")):
            k = int(path.stem.split("-")[1])
            if k not in shards:
                entry = _adopt(path, k)
                if entry is None:
                    path.unlink()  # not one of ours after all: written again below
                else:
                    shards[k] = entry
        if shards != {int(e["index"]): e for e in manifest.get("shards", [])}:
            self._write_manifest(shards)
        return shards

    def write_shard(self, k: int, examples: Sequence[Example]) -> dict[str, Any]:
        """Write shard ``k`` through a temporary name, then list it in the manifest."""
        from safetensors.torch import save

        if k in self.shards:
            raise ValueError(f"shard {k} is finished and is never rewritten")
        tensors = {
            "input_ids": torch.from_numpy(np.concatenate([e.input_ids for e in examples]).astype(np.int32)),
            "loss_mask": torch.from_numpy(np.concatenate([e.loss_mask for e in examples]).astype(np.uint8)),
            "aux": torch.cat([e.stored.aux for e in examples]).contiguous(),
        }
        for name in ("final", "aux_scale", "final_scale", "teacher_ids", "teacher_logits", "teacher_lse"):
            if getattr(examples[0].stored, name) is not None:
                tensors[name] = torch.cat([getattr(e.stored, name) for e in examples]).contiguous()
        lengths = [len(e.input_ids) for e in examples]
        finals = [int(e.stored.rows.numel()) for e in examples]
        columns = {"split": [e.split for e in examples], "index": [int(e.index) for e in examples],
                   "id": [str(e.id) for e in examples], "length": lengths,
                   "row": np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist(),
                   "final_row": np.concatenate([[0], np.cumsum(finals)[:-1]]).astype(int).tolist()}
        # one metadata key: safetensors writes several in no fixed order, and a shard's bytes must not vary
        blob = save(tensors, metadata={"outrider": json.dumps({"format": FORMAT, "version": VERSION, "shard": k,
                                                               "examples": columns})})
        entry = _entry(blob, k, columns, tensors)
        path = self.out / shard_name(k)
        try:
            with atomic_path(path) as tmp:
                _write_file(tmp, blob)
            with self._lock:
                self.shards[k] = entry
                if self.lead:
                    self._write_manifest(self.shards)
        except OSError as e:
            with self._lock:
                self.shards.pop(k, None)
            why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise UserError(f"cannot write {path.name} of {self.out}: {why}; the {len(self.shards)} finished "
                            "shard(s) are kept: free space and rerun the same command to continue") from None
        return entry

    def add(self, entries: Sequence[dict[str, Any]]) -> None:
        """The lead lists shards the other ranks finished (their ``write_shard`` entries)."""
        entries = [e for e in entries if int(e["index"]) not in self.shards]
        if entries:
            with self._lock:
                self.shards.update({int(e["index"]): e for e in entries})
                self._write_manifest(self.shards)

    def _write_manifest(self, shards: dict[int, dict[str, Any]]) -> None:
        ordered = [shards[k] for k in sorted(shards)]
        manifest = {"format": FORMAT, "version": VERSION, "complete": len(ordered) == self.header["shards"],
                    "tokens": sum(e["tokens"] for e in ordered), "bytes": sum(e["bytes"] for e in ordered),
                    "shards": ordered}
        atomic_write_text(self.out / MANIFEST, json.dumps(manifest) + "\n")  # one line: its columns are long


def tokens_sha256(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> str:
    h = hashlib.sha256(input_ids.numpy().astype("<i4").tobytes())
    h.update(loss_mask.numpy().astype(np.uint8).tobytes())
    return h.hexdigest()


def _entry(blob: bytes, k: int, columns: dict[str, list], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A shard's manifest entry: its bytes, checksums, counts and example columns with byte offsets."""
    offsets = _tensor_offsets(blob)
    per_row = "final" if "final" in tensors else "teacher_logits"  # a teacher row's first stored tensor
    aux, final = tensors["aux"], tensors[per_row]
    aux_row = aux[0].numel() * aux.element_size() if aux.shape[0] else 0
    final_row = final.shape[1] * final.element_size()
    return {"index": k, "file": shard_name(k), "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
            "tokens_sha256": tokens_sha256(tensors["input_ids"], tensors["loss_mask"]),
            "tokens": int(tensors["input_ids"].numel()), "final_rows": int(final.shape[0]),
            "examples": {**columns, "aux_offset": [offsets["aux"] + r * aux_row for r in columns["row"]],
                         "final_offset": [offsets[per_row] + r * final_row for r in columns["final_row"]]}}


def _adopt(path: Path, k: int) -> dict[str, Any] | None:
    """The manifest entry of a complete shard file that no manifest lists yet (a capture killed between
    the rename and the manifest's update); None if the file is not such a shard."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    blob = path.read_bytes()
    try:
        tensors = load(blob)
        (n,) = struct.unpack("<Q", blob[:8])
        meta = json.loads((json.loads(blob[8:8 + n]).get("__metadata__") or {}).get("outrider", "{}"))
        if meta.get("format") != FORMAT or meta.get("shard") != k:
            return None
        return _entry(blob, k, meta["examples"], tensors)
    except (SafetensorError, OSError, ValueError, KeyError, struct.error):
        return None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Reading


class OutriderCache:
    """A finished cache folder, opened for training (the reader protocol of ``outrider.train.states.features``).

    ``examples(split)`` -> (input_ids, loss_mask, ids) of a split; ``read(split, index)`` -> ``Stored``.
    """

    kind = "outrider"
    final_prenorm = False  # our final states are after the final norm

    def __init__(self, directory: str | Path):
        self.path = Path(directory).expanduser()
        self.header = read_header(self.path)
        manifest = read_json(self.path / MANIFEST, "manifest") if (self.path / MANIFEST).exists() else {}
        shards = manifest.get("shards", [])
        if not manifest.get("complete") or len(shards) != self.header["shards"]:
            raise UserError(f"the cache {self.path} is incomplete ({len(shards)} of {self.header['shards']} shards): "
                            "rerun the same `outrider capture` command to finish it")
        for entry in shards:
            path = self.path / entry["file"]
            size = path.stat().st_size if path.exists() else -1
            if size != entry["bytes"]:
                raise UserError(f"cache shard {path} is {'missing' if size < 0 else 'truncated'} ({max(size, 0)} of "
                                f"{entry['bytes']} bytes): delete it and rerun `outrider capture` to write it again")
        self.shards = shards
        self.hidden_size = int(self.header["target"]["hidden_size"])
        self.aux_layer_ids = tuple(int(j) for j in self.header["aux_layer_ids"])
        self.n_aux = len(self.aux_layer_ids)
        teacher = self.header.get("teacher") or {"kind": "final"}
        self.topk = int(teacher.get("k", 0)) if teacher.get("kind") == "topk" else 0  # 0: final states stored
        self.where: dict[tuple[str, int], tuple[int, int]] = {}  # (split, index) -> (shard, place in it)
        for s, entry in enumerate(shards):
            for j, (split, index) in enumerate(zip(entry["examples"]["split"], entry["examples"]["index"])):
                self.where[(split, int(index))] = (s, j)
        self._open: dict[int, Any] = {}
        self._verified: set[int] = set()

    @property
    def tokenizer(self) -> dict[str, Any] | None:
        return self.header["target"].get("tokenizer")

    def splits(self) -> list[str]:
        return [s for s in ("train", "eval") if any(k[0] == s for k in self.where)]

    def examples(self, split: str) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
        """Token ids [len] int32, loss masks [len] int8 and ids of a split's examples, by index."""
        from safetensors import SafetensorError, safe_open

        found: dict[int, tuple[np.ndarray, np.ndarray, str]] = {}
        for entry in self.shards:
            cols = entry["examples"]
            if split not in cols["split"]:
                continue
            path = self.path / entry["file"]
            try:
                with safe_open(str(path), framework="pt") as f:
                    ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
            except (SafetensorError, OSError) as e:
                raise self._corrupt(path, str(e)) from None
            if tokens_sha256(ids, mask) != entry["tokens_sha256"]:
                raise self._corrupt(path, "its tokens fail their checksum")
            check_ids(ids, int(self.header["target"]["vocab_size"]), str(path), "tensor input_ids",
                      "the cache was written for another target: capture it again for this one")
            ids, mask = ids.numpy(), mask.numpy().astype(np.int8)
            for sp, index, ex, row, n in zip(cols["split"], cols["index"], cols["id"], cols["row"], cols["length"]):
                if sp == split:
                    found[int(index)] = (ids[row:row + n], mask[row:row + n], ex)
        order = sorted(found)
        if order != list(range(len(order))):
            raise UserError(f"the cache {self.path} lacks examples of its {split} split: capture it again")
        return [found[i][0] for i in order], [found[i][1] for i in order], [found[i][2] for i in order]

    def _corrupt(self, path: Path, why: str) -> UserError:
        return UserError(f"cache shard {path} is corrupt ({why}): delete it and rerun `outrider capture` with the "
                         "same flags to write it again")

    @staticmethod
    def _check_values(path: Path) -> None:
        """No NaN or Inf in a shard's states (its checksum only says it is the file that was written)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                n = nonfinite(f.get_tensor(name))
                if n:
                    raise UserError(f"{path}: tensor {name} holds {n} non-finite value(s) (NaN or Inf) although its "
                                    "checksum passes: the target produced them when it was captured (check the "
                                    "target and --dtype), then capture it again")

    def _handle(self, s: int):
        from safetensors import SafetensorError, safe_open

        if s not in self._open:
            entry = self.shards[s]
            path = self.path / entry["file"]
            if s not in self._verified:
                if file_sha256(path) != entry["sha256"]:
                    raise self._corrupt(path, "sha256 mismatch")
                self._check_values(path)
                self._verified.add(s)
            if len(self._open) >= 64:  # bounded open files: the oldest goes
                self._open.pop(next(iter(self._open)))
            try:
                self._open[s] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise self._corrupt(path, str(e)) from None
        return self._open[s]

    def read(self, split: str, index: int) -> Stored:
        s, j = self.where[(split, int(index))]
        cols = self.shards[s]["examples"]
        f = self._handle(s)
        row, n, frow = cols["row"][j], cols["length"][j], cols["final_row"][j]
        mask = f.get_slice("loss_mask")[row:row + n].numpy()
        rows = torch.from_numpy(teacher_rows(mask))
        m = int(rows.numel())
        fp8 = self.header["dtype"] == "fp8"
        aux, aux_scale = f.get_slice("aux")[row:row + n], f.get_slice("aux_scale")[row:row + n] if fp8 else None
        if self.topk:
            return Stored(aux, aux_scale, None, None, rows, teacher_ids=f.get_slice("teacher_ids")[frow:frow + m],
                          teacher_logits=f.get_slice("teacher_logits")[frow:frow + m],
                          teacher_lse=f.get_slice("teacher_lse")[frow:frow + m])
        return Stored(aux=aux, final=f.get_slice("final")[frow:frow + m], rows=rows, aux_scale=aux_scale,
                      final_scale=f.get_slice("final_scale")[frow:frow + m] if fp8 else None)
