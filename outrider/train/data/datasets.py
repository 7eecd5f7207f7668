"""Token datasets on disk: Parquet shards + manifest, read back as shuffled, padded batches.

Contract: a dataset folder holds ``{train,eval}-NNNNN.parquet`` (columns ``input_ids
list<int32>``, ``loss_mask list<int8>``, ``conv_id string``) and ``manifest.json`` (format, version,
tokenizer identity, chat-template hash, counts, drop reasons, shards). ``load_dataset(dir)`` ->
``TokenDataset``: examples, deterministic shuffled batches drawn by length (to spare padding),
shardable by rank; refuses a folder of another format or version with one line.
``merge_datasets`` joins datasets of one tokenizer (an example whose tokens were seen is dropped);
``subset_dataset`` keeps the examples of at least a given length. ``opening`` is the prompt an
example opens with (what the split keeps on one side); ``split_overlap`` measures how much of one
split's learned text another split holds."""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from outrider.errors import UserError
from outrider.fsutil import atomic_dir, read_text
from outrider.outputs import OWN_FILES
from outrider.train.data.template import vocab_identity
from outrider.values import check_ids

FORMAT = "outrider-tokens"
VERSION = 1


# --------------------------------------------------------------------------------------------
# Writing and reading the token dataset


def require_pyarrow():
    """(pyarrow, pyarrow.parquet), or a one-line ``UserError`` naming the extra to install."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("token datasets are stored as Parquet: install pyarrow "
                        "(pip install 'outrider[data]')") from None
    return pa, pq


def _write_split(directory: Path, split: str, rows: list[tuple[str, list[int], list[int]]],
                 shard_rows: int) -> list[dict[str, Any]]:
    pa, pq = require_pyarrow()
    shards = []
    for k, start in enumerate(range(0, len(rows), shard_rows)):
        chunk = rows[start: start + shard_rows]
        lengths = np.array([len(ids) for _, ids, _ in chunk], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = np.fromiter((t for _, row, _ in chunk for t in row), dtype=np.int32, count=int(lengths.sum()))
        mask = np.fromiter((t for _, _, row in chunk for t in row), dtype=np.int8, count=int(lengths.sum()))
        table = pa.table({
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, type=pa.int32())),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask, type=pa.int8())),
            "conv_id": pa.array([c for c, _, _ in chunk], type=pa.string()),
        })
        name = f"{split}-{k:05d}.parquet"
        pq.write_table(table, directory / name)
        shards.append({"file": name, "examples": len(chunk), "tokens": int(lengths.sum()),
                       "loss_tokens": int(mask.sum(dtype=np.int64))})
    return shards


def write_dataset(out: Path, manifest: dict[str, Any], rows: dict[str, list[tuple[str, list[int], list[int]]]],
                   shard_rows: int) -> None:
    """Both splits' shards and ``manifest.json`` (its ``splits`` filled in here) into ``out``, atomically
    (an earlier folder's output marker and lock carried over, ``outrider.outputs``)."""
    with atomic_dir(out, carry=OWN_FILES) as tmp:
        for split in ("train", "eval"):
            shards = _write_split(tmp, split, rows[split], shard_rows)
            manifest["splits"][split] = {"examples": len(rows[split]), "tokens": sum(s["tokens"] for s in shards),
                                         "loss_tokens": sum(s["loss_tokens"] for s in shards), "shards": shards}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(directory: str | Path) -> dict[str, Any]:
    d = Path(directory).expanduser()
    path = d / "manifest.json"
    if not path.exists():
        raise UserError(f"{d} is not an outrider token dataset (no manifest.json): build one with `outrider data`")
    try:
        manifest = json.loads(read_text(path))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{path} is not an {FORMAT} v{VERSION} manifest: rebuild the data with `outrider data`")
    return manifest


@dataclass
class Batch:
    input_ids: torch.Tensor  # [batch, seq] int64, right-padded with the pad id
    attention_mask: torch.Tensor  # [batch, seq] int64, 1 on real tokens, 0 on padding
    loss_mask: torch.Tensor  # [batch, seq] int64, 1 on assistant tokens to learn (never on padding)
    indices: torch.Tensor  # [batch] int64, example indices in the dataset

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """The token tensors on ``device``; ``indices`` stay on the host (bookkeeping, read there)."""
        return Batch(*(to_device(t, device, non_blocking) for t in (self.input_ids, self.attention_mask,
                                                                     self.loss_mask)), self.indices)

    def cut(self, max_length: int) -> "Batch":
        """The first ``max_length`` positions of every row."""
        return Batch(self.input_ids[:, :max_length], self.attention_mask[:, :max_length],
                     self.loss_mask[:, :max_length], self.indices)


def to_device(t: torch.Tensor, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for CUDA with ``non_blocking`` goes through pinned
    memory, so that the copy is queued behind the device's work instead of waiting for it."""
    if non_blocking and t.device.type == "cpu" and torch.device(device).type == "cuda":
        t = t.contiguous().pin_memory()  # a strided pinned copy would be staged through pageable memory
    return t.to(device, non_blocking=non_blocking)


class TokenDataset:
    """One split of a token dataset in memory: ``ds[i] -> (input_ids [seq], loss_mask [seq])``."""

    def __init__(self, input_ids: list[np.ndarray], loss_mask: list[np.ndarray], conv_ids: list[str],
                 manifest: dict[str, Any], split: str = "train"):
        self.input_ids = input_ids
        self.loss_mask = loss_mask
        self.conv_ids = conv_ids
        self.manifest = manifest
        self.split = split
        self.pad_token_id = int(manifest.get("tokenizer", {}).get("pad_token_id") or 0)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.from_numpy(self.input_ids[i].astype(np.int64)),  # [seq]
                torch.from_numpy(self.loss_mask[i].astype(np.int64)))  # [seq]

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self.input_ids], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(int(m.sum(dtype=np.int64)) for m in self.loss_mask))

    def check_tokenizer(self, tokenizer) -> None:
        """``UserError`` unless ``tokenizer`` is the one the data was built with."""
        want = self.manifest.get("tokenizer", {}).get("vocab_hash")
        have = vocab_identity(tokenizer)["vocab_hash"]
        if want != have:
            raise UserError(f"the data was tokenised with {self.manifest['tokenizer'].get('name')!r}, whose vocabulary "
                            "differs from this target's: rebuild it with `outrider data` for this target")

    def order(self, seed: int, epoch: int = 0) -> np.ndarray:
        """The shuffled example order of one epoch; a function of (seed, epoch) only."""
        return np.random.default_rng([int(seed), int(epoch)]).permutation(len(self))

    def num_batches(self, batch_size: int, world_size: int = 1, drop_last: bool = True) -> int:
        g = batch_size * world_size
        return len(self) // g if drop_last else -(-len(self) // g)

    def collate(self, indices: Sequence[int], pad_to_multiple_of: int = 1) -> Batch:
        idx = [int(i) for i in indices]
        width = max((len(self.input_ids[i]) for i in idx), default=0)
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        ids = torch.full((len(idx), width), self.pad_token_id, dtype=torch.long)  # [batch, seq]
        attn = torch.zeros((len(idx), width), dtype=torch.long)  # [batch, seq]
        mask = torch.zeros((len(idx), width), dtype=torch.long)  # [batch, seq]
        for row, i in enumerate(idx):
            n = len(self.input_ids[i])
            ids[row, :n] = torch.from_numpy(self.input_ids[i].astype(np.int64))
            attn[row, :n] = 1
            mask[row, :n] = torch.from_numpy(self.loss_mask[i].astype(np.int64))
        return Batch(ids, attn, mask, torch.tensor(idx, dtype=torch.long))

    def batches(self, batch_size: int, seed: int = 0, epoch: int = 0, start: int = 0, rank: int = 0,
                world_size: int = 1, drop_last: bool = True, pad_to_multiple_of: int = 1,
                group_by_length: int = 0, batch_tokens: int = 0, cap: int = 0, min_tokens: int = 0
                ) -> Iterator[Batch]:
        """Batches of one epoch, from batch number ``start`` (to resume mid-epoch).

        Step ``s`` takes global batch ``s`` of ``global_batches`` (``G = batch_size * world_size``
        examples each, or a budget of ``batch_tokens * world_size`` padded tokens, or short neighbours
        joined up to ``min_tokens * world_size``); rank ``r`` gets
        its elements ``r, r + world_size, ...``. The union over ranks is the batch a single process
        with ``batch_size = G`` sees. With ``drop_last=False`` the final global batch may be short,
        and a rank's share of it may be empty.
        """
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batching: batch_size={batch_size} rank={rank} world_size={world_size}")
        plan = self.global_batches(batch_size * world_size, seed, epoch, drop_last, group_by_length,
                                   batch_tokens * world_size, cap, pad_to_multiple_of, world_size,
                                   min_tokens * world_size)
        for s in range(start, len(plan)):
            yield self.collate(plan[s][rank::world_size], pad_to_multiple_of)

    def global_batches(self, g: int, seed: int = 0, epoch: int = 0, drop_last: bool = True,
                       group_by_length: int = 0, tokens: int = 0, cap: int = 0, multiple: int = 1,
                       world_size: int = 1, min_tokens: int = 0) -> list[np.ndarray]:
        """The example indices of every global batch of one epoch; a function of (seed, epoch).

        By count (``tokens = 0``): batch ``s`` is ``order[s*g:(s+1)*g]``. With ``group_by_length =
        m > 1`` each window of ``m`` consecutive batches is sorted by length before it is cut
        (similar lengths share a batch: little padding), and the batches are then shuffled again.
        With ``min_tokens > 0`` as well, neighbours in that length order whose padded size (count x
        the widest) is below ``min_tokens`` are joined until the union reaches it, never past
        ``2 * min_tokens``: whole batches of ``g``, so that ranks still split them evenly.

        By tokens (``tokens > 0``): each batch takes the next examples while their padded size
        (count x the widest, lengths cut at ``cap`` and padded to a ``multiple``) stays within
        ``tokens``; the count is then rounded down to a multiple of ``8 * world_size`` (or of
        ``world_size``), so that few distinct batch shapes occur (attention kernels plan per shape).
        An example wider than the budget forms a batch of ``world_size``; the last batch may be
        short (``drop_last`` drops it only below ``world_size``). Windows of ``m *
        tokens`` padded tokens are sorted by length, and the batches shuffled, as above.
        """
        order = self.order(seed, epoch)
        if tokens > 0:
            return self._token_batches(order, tokens, group_by_length, cap, multiple, world_size, drop_last,
                                       np.random.default_rng([int(seed), int(epoch), 1]))
        full = len(self) // g * g
        if group_by_length > 1:
            lengths = self.lengths
            windows = [order[i:min(i + group_by_length * g, full)] for i in range(0, full, group_by_length * g)]
            order = np.concatenate([w[np.argsort(lengths[w], kind="stable")] for w in windows] + [order[full:]])
        plan = [order[i:i + g] for i in range(0, full, g)]
        if group_by_length > 1:
            if min_tokens > 0:
                plan = self._joined(plan, min_tokens, cap, multiple)
            plan = [plan[i] for i in np.random.default_rng([int(seed), int(epoch), 1]).permutation(len(plan))]
        if not drop_last and full < len(self):
            plan.append(order[full:])
        return plan

    def _widths(self, cap: int, multiple: int) -> tuple[np.ndarray, np.ndarray]:
        """Lengths cut at ``cap`` [N], and the padded width of each example alone [N]."""
        lengths = np.minimum(self.lengths, cap) if cap > 0 else self.lengths
        return lengths, -(-lengths // multiple) * multiple

    def _joined(self, plan: list[np.ndarray], min_tokens: int, cap: int, multiple: int) -> list[np.ndarray]:
        """Consecutive batches below ``min_tokens`` padded tokens joined (see ``global_batches``)."""
        _, width = self._widths(cap, multiple)

        def size(rows: np.ndarray) -> int:
            return len(rows) * int(width[rows].max())

        out: list[np.ndarray] = []
        for batch in plan:
            last = out[-1] if out else None
            if last is not None and size(last) < min_tokens and size(batch) < min_tokens \
                    and size(np.concatenate([last, batch])) <= 2 * min_tokens:
                out[-1] = np.concatenate([last, batch])
            else:
                out.append(batch)
        return out

    def _token_batches(self, order: np.ndarray, tokens: int, group_by_length: int, cap: int, multiple: int,
                       world_size: int, drop_last: bool, rng: np.random.Generator) -> list[np.ndarray]:
        lengths, width = self._widths(cap, multiple)  # [N] each
        if group_by_length > 1:
            window = (np.cumsum(width[order]) - 1) // (group_by_length * tokens)  # [N] window of each place
            order = order[np.lexsort((lengths[order], window))]  # stable: by window, then by length
        quantum = 8 * world_size
        plan, i, n_all = [], 0, len(order)
        while i < n_all:
            n, w = 0, 0
            while i + n < n_all and (n + 1) * max(w, width[order[i + n]]) <= tokens:
                w = max(w, width[order[i + n]])
                n += 1
            n = max(n - n % (quantum if n >= quantum else world_size), world_size)
            plan.append(order[i:i + n])
            i += n
        if drop_last and plan and len(plan[-1]) < world_size:  # a short last batch stays: its loss is a mean
            plan.pop()
        if group_by_length > 1:
            plan = [plan[j] for j in rng.permutation(len(plan))]
        return plan


def load_dataset(directory: str | Path, split: str = "train") -> TokenDataset:
    """Load one split (``train`` or ``eval``) of a directory written by ``build_dataset``."""
    d = Path(directory).expanduser()
    manifest = read_manifest(d)
    if split not in manifest.get("splits", {}):
        raise UserError(f"{d} has no '{split}' split (it has: {', '.join(manifest.get('splits', {}))})")
    _, pq = require_pyarrow()
    input_ids: list[np.ndarray] = []
    loss_mask: list[np.ndarray] = []
    conv_ids: list[str] = []
    vocab = manifest.get("tokenizer", {}).get("vocab_size")
    for shard in manifest["splits"][split]["shards"]:
        path = d / shard["file"]
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {path}: {e} (rebuild the data with `outrider data`)") from None
        if table.num_rows != shard["examples"]:
            raise UserError(f"{path} has {table.num_rows} rows, the manifest says {shard['examples']}: "
                            "rebuild the data")
        for column, into, dtype in (("input_ids", input_ids, np.int32), ("loss_mask", loss_mask, np.int8)):
            arr = table.column(column).combine_chunks()
            offsets = arr.offsets.to_numpy()
            values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
            if column == "input_ids" and vocab:
                check_ids(values, int(vocab), str(path), "column input_ids", "the shard is damaged or was written "
                          "for another tokenizer: rebuild the data with `outrider data`")
            into.extend(values[offsets[k]: offsets[k + 1]] for k in range(len(arr)))
        conv_ids.extend(table.column("conv_id").to_pylist())
    return TokenDataset(input_ids, loss_mask, conv_ids, manifest, split)


def merge_datasets(directories: Sequence[str | Path], out: str | Path, shard_rows: int = 8192) -> dict[str, Any]:
    """Several token datasets of one tokenizer -> one directory ``out`` (written atomically).

    Each split keeps its examples in the order given; an example whose tokens an earlier one
    already has (in either split, any directory) is dropped and counted, so that merging a dataset
    with itself, or two builds of one source, never trains on an example twice and never puts it on
    both sides of the split. Conversation ids are not compared: sources without ids number their
    records, and record 7 of one file is not record 7 of another. Datasets of another vocabulary
    or chat template are refused; pad ids may differ (the first's is kept: padding is never
    attended nor learned) and the end-of-turn ids are pooled (each dataset's loss masks are
    already final). Returns the new manifest.
    """
    dirs = [Path(d).expanduser() for d in directories]
    if len(dirs) < 2:
        raise UserError("give at least two dataset directories to merge")
    manifests = [read_manifest(d) for d in dirs]
    first = manifests[0]
    for d, m in zip(dirs[1:], manifests[1:]):
        for key in ("vocab_hash", "chat_template_hash"):  # what token ids and loss masks mean
            if m["tokenizer"].get(key) != first["tokenizer"].get(key):
                raise UserError(f"{d} was tokenised differently from {dirs[0]} ({key} differs): "
                                "build both with the same target")
    seen: set[bytes] = set()  # digests of the examples' tokens and masks
    rows: dict[str, list[tuple[str, list[int], list[int]]]] = {"train": [], "eval": []}
    duplicates = 0
    for d, m in zip(dirs, manifests):
        for split in ("train", "eval"):
            if split not in m.get("splits", {}):
                continue
            ds = load_dataset(d, split)
            for ids, mask, conv in zip(ds.input_ids, ds.loss_mask, ds.conv_ids):
                digest = hashlib.blake2b(ids.astype(np.int32).tobytes() + mask.astype(np.int8).tobytes(),
                                         digest_size=16).digest()
                if digest in seen:
                    duplicates += 1
                    continue
                seen.add(digest)
                rows[split].append((conv, ids.tolist(), mask.tolist()))
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "target": first.get("target"),
        "tokenizer": {**first["tokenizer"],  # padding is never attended nor learned: the first's pad id serves
                      "end_token_ids": sorted({int(t) for m in manifests
                                               for t in m["tokenizer"].get("end_token_ids", [])})},
        "source": {"merged": [{"directory": str(d), "target": m.get("target"), "source": m.get("source"),
                               "regenerate": m.get("regenerate"), "counts": m.get("counts")}
                              for d, m in zip(dirs, manifests)]},
        "max_length": max(int(m.get("max_length") or 0) for m in manifests),
        "regenerate": None,
        "counts": {"kept": len(rows["train"]) + len(rows["eval"]), "train": len(rows["train"]),
                   "eval": len(rows["eval"]), "dropped": {"duplicate": duplicates} if duplicates else {}},
        "columns": first["columns"],
        "splits": {},
    }
    write_dataset(Path(out).expanduser(), manifest, rows, shard_rows)
    return manifest


def subset_dataset(directory: str | Path, out: str | Path, min_length: int, shard_rows: int = 8192
                   ) -> dict[str, Any]:
    """The examples of ``directory`` with at least ``min_length`` tokens, both splits, into ``out``
    (written atomically; a profile of long-sequence steps). Returns the new manifest."""
    d = Path(directory).expanduser()
    manifest = read_manifest(d)
    rows: dict[str, list[tuple[str, list[int], list[int]]]] = {"train": [], "eval": []}
    for split in rows:
        if split in manifest.get("splits", {}):
            ds = load_dataset(d, split)
            rows[split] = [(c, ids.tolist(), m.tolist()) for ids, m, c in zip(ds.input_ids, ds.loss_mask, ds.conv_ids)
                           if len(ids) >= min_length]
    if not rows["train"]:
        raise UserError(f"{d} has no training example of {min_length} tokens or more")
    new = {**manifest, "source": {"subset_of": str(d), "min_length": int(min_length)},
           "counts": {"kept": len(rows["train"]) + len(rows["eval"]), "train": len(rows["train"]),
                      "eval": len(rows["eval"]), "dropped": {}}, "splits": {}}
    write_dataset(Path(out).expanduser(), new, rows, shard_rows)
    return new


def opening(input_ids: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray) -> bytes:
    """The tokens an example opens with, before its first learned token (system and first user
    turn), as bytes: examples with one opening share their first reply when it was regenerated
    greedily, and the later exchanges of one conversation share it too."""
    mask = np.asarray(loss_mask)  # [seq]
    learned = np.flatnonzero(mask)
    end = int(learned[0]) if len(learned) else len(mask)
    return np.asarray(input_ids[:end], dtype=">i4").tobytes()


def split_note(held: TokenDataset | None) -> str | None:
    """What a run's summary says of an eval split drawn one by one (a dataset built before
    ``split_by``, or merged): eval examples may open as train ones do, and their scores read high."""
    if held is None or len(held) == 0 or held.manifest.get("split_by"):
        return None
    return ("the data's eval split was not drawn by opening (no split_by in its manifest): eval examples that open "
            "as train ones do score high (benchmarks/split_check.py measures it; `outrider data` rebuilds the split)")


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def split_overlap(train: TokenDataset, held: TokenDataset) -> dict[str, Any]:
    """How much of ``held``'s learned text ``train`` already holds, token for token.

    For each held example, the longest prefix it shares with any train example: a learned token
    inside it sits after the same context in a train example, so a head trained long enough can
    recall it rather than predict it (an estimate of acceptance on ``held`` then reads high). Also
    the held examples whose opening (``opening``) a train example has. Returns counts and
    ``seen_share``, the share of ``held``'s learned tokens inside a shared prefix."""
    keys = sorted(np.asarray(ids, dtype=">i4").tobytes() for ids in train.input_ids)  # byte order = token order
    openings = {opening(ids, m) for ids, m in zip(train.input_ids, train.loss_mask)}
    seen_tokens = loss_tokens = seen_examples = shared_openings = 0
    for ids, mask in zip(held.input_ids, held.loss_mask):
        ids = np.asarray(ids, dtype=np.int64)  # [seq]
        mask = np.asarray(mask)  # [seq]
        at = bisect.bisect_left(keys, ids.astype(">i4").tobytes())
        shared = max((_common_prefix(ids, np.frombuffer(keys[j], dtype=">i4").astype(np.int64))
                      for j in (at - 1, at) if 0 <= j < len(keys)), default=0)
        seen = int(mask[:shared].sum())
        seen_tokens += seen
        seen_examples += int(seen > 0)
        shared_openings += int(opening(ids, mask) in openings)
        loss_tokens += int(mask.sum())
    return {"examples": len(held), "loss_tokens": loss_tokens, "shared_openings": shared_openings,
            "seen_examples": seen_examples, "seen_loss_tokens": seen_tokens,
            "seen_share": seen_tokens / loss_tokens if loss_tokens else 0.0}


def load_split(data: str, split: str, required: bool) -> TokenDataset | None:
    manifest = read_manifest(data)
    if split not in manifest.get("splits", {}) or manifest["splits"][split].get("examples", 0) == 0:
        if required:
            raise UserError(f"the dataset {data} has no {split} examples: build it with `outrider data` "
                            "from conversations that have assistant turns")
        return None
    return load_dataset(data, split)


def consecutive_groups(lengths: Sequence[int], limit: int) -> list[list[int]]:
    """Indices of consecutive examples packed greedily into groups of at most ``limit`` tokens (an
    example longer than ``limit`` is a group of its own): cache shards, streamed passes."""
    groups: list[list[int]] = []
    size = 0
    for i, n in enumerate(lengths):
        if not groups or size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


# On CUDA, batch widths are padded to a multiple of this: attention backends (cuDNN) build an
# execution plan per shape, tens of ms of host time per new width and TTT step when every
# length-grouped batch has a new width; 16 widths up to 1024 keep them cached.
PAD_MULTIPLE_CUDA = 64


class BatchCursor:
    """The data position: the next micro-batch is batch ``batch`` of epoch ``epoch`` (order seeded by
    ``seed``); batches of ``batch_size`` sequences, or of ``batch_tokens`` padded tokens. Each
    epoch's plan (``TokenDataset.global_batches``) is computed once, when the epoch starts."""

    def __init__(self, ds: TokenDataset, cfg: Any, env: Any, seed: int, epoch: int = 0,
                 batch: int = 0):
        self.ds, self.cfg, self.env, self.seed = ds, cfg, env, seed
        self.pad = PAD_MULTIPLE_CUDA if env.device.type == "cuda" else 1
        self.epoch, self.batch = epoch, batch
        self._plan = self._epoch_plan(epoch)

    def _epoch_plan(self, epoch: int) -> list[np.ndarray]:
        cfg, w = self.cfg, self.env.world_size
        return self.ds.global_batches(cfg.batch_size * w, self.seed, epoch, True, cfg.group_by_length,
                                      cfg.batch_tokens * w, cfg.max_length, self.pad, w, cfg.min_batch_tokens * w)

    def next(self) -> Batch:
        if self.batch >= len(self._plan):
            self.epoch, self.batch = self.epoch + 1, 0
            self._plan = self._epoch_plan(self.epoch)
        rows = self._plan[self.batch][self.env.rank::self.env.world_size]  # this rank's share
        self.batch += 1
        return self.ds.collate(rows, self.pad)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed}

    def epoch_plan(self, epoch: int) -> list[np.ndarray]:
        """The global batches (example indices, all ranks) of ``epoch``, in order."""
        return self._plan if epoch == self.epoch else self._epoch_plan(epoch)
