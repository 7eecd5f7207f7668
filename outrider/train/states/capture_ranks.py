"""The ranks of a data-parallel capture (``torchrun --nproc-per-node N -m outrider capture ...``):
which shards each rank captures, and how the ranks agree, report progress and stop together.

Contract:
- ``assign(tokens, world)``: the shards still to capture (``{index: tokens}``) dealt to ``world``
  ranks balanced by tokens: largest first (ties: the lower index) to the rank holding the fewest
  tokens so far (ties: the lower rank); each rank's list ascending, so a rank starts at its first
  missing shard. Every rank computes the same deal; the shard plan itself (``cache_capture``)
  never depends on N, so the cache is the same whatever N, and a rerun with another N deals
  what is still missing.
- ``Ranks(env)`` (``outrider.train.loop.dist.DistEnv``; None: one process). ``exchange(payload)``: a
  JSON-able dict from every rank, all of them returned in rank order on every rank (raw bytes
  over the process group, or a gloo group beside NCCL; nothing unpickled). ``settle(error,
  **payload)`` is where the ranks meet: with no error anywhere it returns the payloads;
  otherwise every rank raises: rank 0 a ``UserError`` whose one line names the first failing
  rank (the line alone when every rank failed alike), the others ``RankStopped`` (quiet: the
  CLI prints nothing, exit 2), except a rank whose own error is not a user error: it re-raises
  it (a bug keeps its traceback). On one process ``settle`` raises the error itself, so
  single-process behaviour is unchanged. A peer lost mid-exchange (a killed rank) is the same:
  rank 0 says so in one line. ``leave()``: the ranks meet at a barrier before the process group
  ends (without it gloo often aborted a rank at teardown on the CPU; with it rarely, cause still
  open: benchmarks/RESULTS.md).
- ``rank_placement(device_map, local_rank, local_world, gpus)``: ``--device-map`` for one of
  ``local_world`` ranks on a host of ``gpus`` GPUs: the rank owns ``gpus // local_world``
  consecutive GPUs; a named map (``auto``, ``balanced``...) is kept with accelerate's
  ``max_memory`` listing only those GPUs (and a ``1/local_world`` share of the host memory), a
  JSON map's GPU indices count from the rank's first GPU. Without GPUs the map is kept as is.
- ``differ(replies, key)``: which fields of ``replies[r][key]`` (a dict) differ from rank 0's,
  per rank: ranks started with different commands are refused before anything is written.

Not done here: capturing or writing shards (``outrider.train.states.cache_capture``, ``cache``), the
process group itself (``outrider.train.loop.dist``), signals.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as torch_dist

from outrider.errors import UserError
from outrider.train.loop import dist


class RankStopped(UserError):
    """This rank stopped because another failed; rank 0 prints the line, this rank nothing."""

    quiet = True


def assign(tokens: dict[int, int], world: int) -> list[list[int]]:
    """Shards ``{index: tokens}`` -> ``world`` lists of shard indices, balanced by tokens (see above)."""
    load = [0] * world
    deal: list[list[int]] = [[] for _ in range(world)]
    for k in sorted(tokens, key=lambda k: (-tokens[k], k)):
        r = min(range(world), key=lambda r: (load[r], r))
        deal[r].append(k)
        load[r] += tokens[k]
    return [sorted(d) for d in deal]


def _line(error: BaseException) -> str:
    if isinstance(error, UserError):
        return str(error)
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class Ranks:
    """The ranks of one capture (see the module docstring)."""

    def __init__(self, env: dist.DistEnv | None = None):
        self.env = env
        self.rank = env.rank if env is not None else 0
        self.world = env.world_size if env is not None else 1
        self.local_rank = env.local_rank if env is not None else 0
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world)) if env is not None else 1
        self._lost = False  # a peer was lost: no more collectives
        self.group = dist.host_group(env) if env is not None else None  # NCCL ranks talk through gloo

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def exchange(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        if not self.distributed:
            return [payload]
        try:
            parts = dist.gather_bytes(json.dumps(payload).encode(), self.env, self.group)
        except RuntimeError:  # gloo or NCCL: a peer died (killed) or the group broke
            self._lost = True
            message = ("lost contact with another rank (killed?): the finished shards are kept; rerun the same "
                       "command, with any number of ranks, to go on")
            raise (UserError(message) if self.lead else RankStopped(message)) from None
        return [json.loads(p) for p in parts]

    def leave(self) -> None:
        """Wait for every rank before the process group ends (see the module docstring); a peer already
        gone is not waited for."""
        if self.distributed and not self._lost:
            try:  # a barrier, not a gather: a rank leaving right after a gather can still abort a peer
                if self.group is not None:
                    torch_dist.barrier(group=self.group)
                else:
                    dist.barrier(self.env)
            except RuntimeError:  # a peer died during the wait: it is gone, nothing left to wait for
                self._lost = True

    def settle(self, error: BaseException | None, suffix: str = "", **payload: Any) -> list[dict[str, Any]]:
        """Meet the other ranks; raise on every rank if any brought an error (see the module docstring)."""
        if not self.distributed:
            if error is not None:
                raise error
            return [payload]
        replies = self.exchange({**payload, "error": None if error is None else _line(error)})
        failed = [(r, p["error"]) for r, p in enumerate(replies) if p["error"] is not None]
        if not failed:
            return replies
        if error is not None and not isinstance(error, UserError):
            raise error
        rank, line = failed[0]
        alike = len(failed) == self.world and all(p["error"] == line for p in replies)
        message = (line if alike else f"rank {rank} of {self.world} failed: {line}")
        message += suffix if " kept" not in line else ""  # the line may say already what was kept
        raise UserError(message) if self.lead else RankStopped(message)


def differ(replies: list[dict[str, Any]], key: str) -> dict[int, list[str]]:
    """Rank -> the fields of its ``key`` dict that differ from rank 0's (ranks that agree left out)."""
    base = replies[0][key] or {}
    out = {}
    for r, p in enumerate(replies[1:], start=1):
        mine = p[key] or {}
        fields = sorted(k for k in set(base) | set(mine) if base.get(k) != mine.get(k))
        if fields:
            out[r] = fields
    return out


def rank_placement(device_map: Any, local_rank: int, local_world: int, gpus: int,
                   free: dict[Any, int] | None = None) -> tuple[Any, dict[Any, int] | None]:
    """(the rank's device map, accelerate's ``max_memory`` or None); ``free``: accelerate's
    ``get_max_memory()`` ({GPU index: bytes, "cpu": bytes}), read when needed and not given."""
    if device_map is None or gpus == 0:
        return device_map, None
    per = gpus // local_world
    if per < 1:
        raise UserError(f"--device-map with {local_world} ranks on a host of {gpus} GPU(s): each rank needs at least "
                        "one GPU of its own; start at most as many ranks as GPUs")
    own = list(range(local_rank * per, (local_rank + 1) * per))
    if isinstance(device_map, dict):
        def place(dev: Any) -> Any:
            index = dev if isinstance(dev, int) else (int(dev.split(":")[1]) if str(dev).startswith("cuda:")
                                                      else 0 if dev == "cuda" else None)
            if index is None:
                return dev
            if index >= per:
                raise UserError(f"--device-map places a module on GPU {index}, but each of the {local_world} ranks "
                                f"owns {per} GPU(s) (indices count from the rank's first GPU)")
            return own[index] if isinstance(dev, int) else f"cuda:{own[index]}"
        return {name: place(dev) for name, dev in device_map.items()}, None
    if free is None:
        from accelerate.utils import get_max_memory

        free = get_max_memory()
    memory = {g: free[g] for g in own if g in free}
    if "cpu" in free:
        memory["cpu"] = free["cpu"] // local_world
    return device_map, memory
