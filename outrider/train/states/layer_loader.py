"""Bring one unit of a checkpoint (a decoder layer, the embedding) to the device while the previous one computes.

Contract:
- A ``Unit`` is a module of the meta skeleton plus its ``Recipe``s (``outrider.train.states.weights``);
  its ``Layout`` places every raw checkpoint tensor it reads at a 256-byte aligned offset of one
  byte buffer, tensors of one kind (all experts' packed gate weights, then their scales, ...)
  side by side so that ``stacked`` views them as one [E, ...] tensor without a copy.
- ``LayerLoader.stream(units, then)`` yields ``Loaded`` units in order. Unit k+1 is read while
  the caller computes unit k (and ``then``, the next call's first unit, while it computes the
  last): a background thread ``preadv``s its bytes from the shard files into
  one of two host staging buffers (pinned on CUDA; several reader threads), then, on CUDA, copies
  the buffer to a fresh device buffer on a side stream and records an event that the compute
  stream waits on. On the CPU the staging buffer itself is the unit's memory. The caller must be
  done with unit k-1 (its module emptied) before it asks for unit k+1: the staging buffer it used
  is then refilled. A finished stream leaves ``then`` loading for the next call that starts with it.
- Timings per unit (``UnitTiming``): host read seconds, the host's wait for the unit, and on CUDA
  events around the copy and the compute, read once the caller has synchronized.

Not done here: which tensors a module needs (``weights``), running the module (``stream``), disk
reads that bypass the page cache (O_DIRECT), more than one unit in flight.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from outrider.train.states.weights import Recipe, SafetensorsFiles, build_tensor

ALIGN = 256
PIECE = 64 << 20  # bytes one reader thread reads per call


@dataclass
class Layout:
    offsets: dict[str, int]  # checkpoint tensor -> byte offset in the unit's buffer
    nbytes: int  # multiple of ALIGN

    @classmethod
    def of(cls, files: SafetensorsFiles, recipes: Sequence[Recipe], congruent: bool = False) -> "Layout":
        """``congruent``: each tensor at an offset equal to its file offset modulo ALIGN, so that a
        view of it is aligned as a memory-mapped tensor is (CPU kernels for a single row pick their
        summation order by alignment, and transformers computes from the memory map on the CPU)."""
        offsets, at = {}, 0
        for recipe in recipes:
            for name in recipe.sources():
                if name not in offsets:
                    if congruent:
                        at += (files.entries[name].begin - at) % ALIGN
                    offsets[name] = at
                    at += files.nbytes(name) if congruent else math.ceil(files.nbytes(name) / ALIGN) * ALIGN
        return cls(offsets, max(math.ceil(at / ALIGN) * ALIGN, ALIGN))


@dataclass
class Unit:
    name: str  # "embed_tokens", "layers.3"
    module: torch.nn.Module  # on the meta device between uses
    recipes: list[Recipe]
    layout: Layout
    built_bytes: int  # device bytes of the tensors built (dequantized, fused, cast) rather than viewed

    @classmethod
    def of(cls, files: SafetensorsFiles, name: str, module: torch.nn.Module, recipes: list[Recipe],
           congruent: bool = False) -> "Unit":
        built = sum(r.dense_bytes for r in recipes
                    if r.kind != "plain" or files.entries[r.parts[0].names[0][0]].dtype != r.dtype)
        return cls(name, module, recipes, Layout.of(files, recipes, congruent), built)

    @property
    def raw_bytes(self) -> int:
        return self.layout.nbytes


@dataclass
class UnitTiming:
    name: str
    nbytes: int
    read_s: float = 0.0  # host: bytes read into the staging buffer
    wait_s: float = 0.0  # host: blocked waiting for the unit
    compute_s: float = 0.0  # host-timed compute (CPU; on CUDA the events time it)
    build_s: float = 0.0  # of which building the weights
    events: dict[str, torch.cuda.Event] = field(default_factory=dict)  # copy0/1, compute0, built, compute1

    def ms(self, a: str, b: str) -> float:
        return self.events[a].elapsed_time(self.events[b]) if a in self.events and b in self.events else 0.0


class Loaded:
    """A unit's raw tensors on the device: ``get(name)`` and ``stacked(names)`` views of one buffer."""

    def __init__(self, unit: Unit, files: SafetensorsFiles, buf: torch.Tensor, timing: UnitTiming):
        self.unit, self.files, self.buf, self.timing = unit, files, buf, timing  # buf: [nbytes] uint8

    def get(self, name: str) -> torch.Tensor:
        e, at = self.files.entries[name], self.unit.layout.offsets[name]
        return self.buf[at: at + e.nbytes].view(e.dtype).view(e.shape)

    def stacked(self, names: Sequence[str]) -> torch.Tensor | None:
        """[len(names), *shape] view of equally shaped tensors at a constant stride, else None."""
        entries = [self.files.entries[n] for n in names]
        offsets = [self.unit.layout.offsets[n] for n in names]
        e0 = entries[0]
        if any(e.dtype != e0.dtype or e.shape != e0.shape for e in entries) or len(names) < 2:
            return None
        step = offsets[1] - offsets[0]
        if step <= 0 or step % e0.dtype.itemsize or any(b - a != step for a, b in zip(offsets, offsets[1:])):
            return None
        inner = [1] * len(e0.shape)
        for d in range(len(e0.shape) - 2, -1, -1):
            inner[d] = inner[d + 1] * e0.shape[d + 1]
        flat = self.buf.view(e0.dtype)  # [nbytes / itemsize]
        return torch.as_strided(flat, (len(names), *e0.shape), (step // e0.dtype.itemsize, *inner),
                                flat.storage_offset() + offsets[0] // e0.dtype.itemsize)

    def materialise(self, temp_bytes: int) -> None:
        """Give the unit's module its real tensors (views of the buffer where nothing is converted)."""
        sd = {r.key: build_tensor(r, self.get, self.stacked, temp_bytes) for r in self.unit.recipes}
        self.unit.module.load_state_dict(sd, strict=True, assign=True)

    def release(self) -> None:
        """Back to the meta device: the buffer and every built tensor are freed."""
        self.unit.module.to_empty(device="meta")
        self.buf = None


class LayerLoader:
    """Reads units ahead of the compute; see the module docstring."""

    def __init__(self, files: SafetensorsFiles, device: torch.device, max_unit_bytes: int, read_threads: int = 8):
        self.files, self.device = files, device
        self.cuda = device.type == "cuda"
        self.slots = [_aligned(max_unit_bytes, self.cuda) for _ in range(2)]
        self.slot_done: list[torch.cuda.Event | None] = [None, None]  # the copy out of each slot
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="outrider-load")
        self.readers = ThreadPoolExecutor(max(1, read_threads), thread_name_prefix="outrider-read")
        self.fds = [os.open(p, os.O_RDONLY) for p in files.paths]
        self._next_slot = 0
        self._pending: tuple[Unit, Future] | None = None  # the next call's first unit, already loading

    def stream(self, units: Sequence[Unit], then: Unit | None = None) -> Iterator[Loaded]:
        """The units in order, each resident on the device; unit k+1 loads during unit k, and
        ``then`` (the first unit of the next call, if known) during the last one."""
        if not units:
            return
        pending, self._pending = self._pending, None
        ahead = pending[1] if pending is not None and pending[0] is units[0] else self._submit(units[0])
        for k in range(len(units)):
            t0 = time.perf_counter()
            buf, timing = ahead.result()
            timing.wait_s = time.perf_counter() - t0
            follow = units[k + 1] if k + 1 < len(units) else then
            ahead = self._submit(follow) if follow is not None else None
            if k + 1 == len(units) and ahead is not None:
                self._pending = (follow, ahead)
            if self.cuda:
                main = torch.cuda.current_stream(self.device)
                main.wait_event(timing.events["copy1"])
                buf.record_stream(main)  # freed for reuse only after the compute queued on it
            yield Loaded(units[k], self.files, buf, timing)

    def _submit(self, unit: Unit) -> Future:
        slot, self._next_slot = self._next_slot, 1 - self._next_slot
        return self.thread.submit(self._load, slot, unit)

    def _load(self, slot: int, unit: Unit) -> tuple[torch.Tensor, UnitTiming]:
        if self.slot_done[slot] is not None:
            self.slot_done[slot].synchronize()  # its previous copy to the device has finished
        timing = UnitTiming(unit.name, unit.raw_bytes)
        t0 = time.perf_counter()
        host = self.slots[slot][: unit.raw_bytes]
        self._read(unit, host)
        timing.read_s = time.perf_counter() - t0
        if not self.cuda:
            return host, timing
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            timing.events = {k: torch.cuda.Event(enable_timing=True) for k in ("copy0", "copy1")}
            timing.events["copy0"].record(self.copy_stream)
            buf = torch.empty(unit.raw_bytes, dtype=torch.uint8, device=self.device)
            buf.copy_(host, non_blocking=True)
            timing.events["copy1"].record(self.copy_stream)
        self.slot_done[slot] = timing.events["copy1"]
        return buf, timing

    def _read(self, unit: Unit, host: torch.Tensor) -> None:
        """preadv every tensor of the unit into ``host`` at its layout offset, in parallel pieces."""
        view = memoryview(host.numpy())
        jobs = []
        for name, at in unit.layout.offsets.items():
            e = self.files.entries[name]
            for start in range(0, e.nbytes, PIECE):
                n = min(PIECE, e.nbytes - start)
                jobs.append((self.fds[e.file], view[at + start: at + start + n], e.begin + start))
        for got, (_, mv, _) in zip(self.readers.map(_pread, jobs), jobs):
            if got != len(mv):
                raise OSError(f"short read of {unit.name}: the checkpoint changed on disk while streaming")

    def close(self) -> None:
        self.thread.shutdown(wait=True)
        self.readers.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
        self.fds, self.slots = [], []


def _aligned(nbytes: int, pin: bool) -> torch.Tensor:
    """[nbytes] uint8 host buffer starting at an ALIGN-aligned address."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start: start + nbytes]


def _pread(job: tuple[int, memoryview, int]) -> int:
    fd, mv, offset = job
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done
