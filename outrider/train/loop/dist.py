"""Multi-process training through PyTorch's own engine: process group, data parallelism, collectives.

Contract:
- ``init_from_env(device)`` reads the variables ``torchrun`` sets (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and, when ``WORLD_SIZE > 1``, starts the
  default process group: ``nccl`` on CUDA (one GPU per process, ``cuda:LOCAL_RANK``), ``gloo``
  on CPU. Without those variables it returns a single-process ``DistEnv`` and starts nothing, so
  the same trainer code runs under ``python`` and under ``torchrun``.
- ``wrap(module, env)`` applies the parallelism in one place, after the model is built
  single-device (as torchtitan does): DistributedDataParallel for ``world_size > 1``, the module
  itself otherwise. Data sharding is by rank in ``TokenDataset.batches`` (rank ``r`` takes
  elements ``r, r+W, ...`` of every global batch), so the global batch is
  ``batch_size * world_size * grad_accum`` sequences.
- ``all_reduce_sum``, ``gather_bytes`` and ``barrier`` do nothing on one process (``gather_bytes``
  carries raw bytes, JSON for its callers: nothing is unpickled; through ``host_group``, a gloo
  group beside NCCL, it stays in host memory). Only rank 0
  writes files and logs (``env.is_main``); the trainer puts a barrier around every checkpoint.
- ``shard_head`` is where FSDP2 (``torch.distributed.fsdp.fully_shard``) would shard a head too
  large to replicate (a Kimi-K2.5-sized head with a 32k draft vocabulary is ~1.2 B parameters
  in float32, ~20 GB with Adam states: it still fits one H200, so DDP is used everywhere today).

Not done here: tensor or pipeline parallelism of the target, multi-node rendezvous settings
(torchrun's own flags cover them), FSDP2 checkpointing (``shard_head`` refuses, see its docstring).
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

from outrider.errors import UserError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None on one process
    owns_group: bool = False  # True when init_from_env started the process group (shutdown ends it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer (torchrun sets it)") from None


def init_from_env(device: torch.device | str | None = None) -> DistEnv:
    """Join the process group torchrun describes (or none); pick this process's device.

    ``device`` is the device kind the user asked for (``cuda``, ``cpu`` or None = CUDA if
    available); under torchrun with CUDA each process takes ``cuda:LOCAL_RANK``.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but CUDA is not available: use --device cpu")
    if kind == "cuda":
        if world > 1 and local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): "
                            "start torchrun with --nproc-per-node at most the number of GPUs")
        index = local_rank if world > 1 else (torch.device(device).index if device is not None else None)
        dev = torch.device("cuda", index if index is not None else torch.cuda.current_device())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(kind)
    if world <= 1:
        return DistEnv(0, 1, 0, dev, None)
    if not 0 <= rank < world:
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world}")
    if torch_dist.is_initialized():  # started by the caller, who also ends it
        return DistEnv(rank, world, local_rank, dev, str(torch_dist.get_backend()), owns_group=False)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world}
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    torch_dist.init_process_group(**kwargs)
    return DistEnv(rank, world, local_rank, dev, backend, owns_group=True)


def leaving(env: DistEnv) -> None:
    """Call as a rank starts to leave the group (its work done or failed). Once a peer has exited with
    an error torchrun stops the others with SIGTERM: from here on its default action ends this rank
    at once, instead of a Python handler raising inside the group's teardown (which aborted the rank
    with SIGABRT in about one failing run in three)."""
    if env.distributed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def shutdown(env: DistEnv) -> None:
    """Leave the process group started by ``init_from_env`` (a no-op on one process)."""
    leaving(env)
    if env.owns_group and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        if env.device.type == "cuda":
            torch_dist.barrier(device_ids=[env.device.index])
        else:
            torch_dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place; returns it (unchanged on one process)."""
    if env.distributed:
        moved = tensor.to(env.device)
        torch_dist.all_reduce(moved, op=torch_dist.ReduceOp.SUM)
        if moved is not tensor:
            tensor.copy_(moved)
    return tensor


def gather_bytes(data: bytes, env: DistEnv, group: Any = None) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank (one process: ``[data]``). ``group``: a
    gloo group (``host_group``) to send it through host memory, else the default group on ``env.device``."""
    if not env.distributed:
        return [data]
    device = torch.device("cpu") if group is not None else env.device
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(env.world_size)]
    torch_dist.all_gather(sizes, size, group=group)
    width = max(int(s) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8, device=device)  # [width] padded with zeros
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(mine) for _ in range(env.world_size)]
    torch_dist.all_gather(parts, mine, group=group)
    return [bytes(p[:int(n)].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]


def host_group(env: DistEnv) -> Any:
    """A gloo group over all ranks for small host-side messages when the default group is NCCL (it
    then needs no GPU memory, and a dead peer is an error rather than a wait); None otherwise. Every
    rank must call it."""
    if env.distributed and env.backend == "nccl":
        return torch_dist.new_group(backend="gloo")
    return None


def wrap(module: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """Data parallelism for a module built single-device (its parameters already on ``env.device``).

    DDP broadcasts rank 0's parameters at construction, averages gradients over ranks in the
    backward, and skips that average inside ``no_sync()`` (the trainer's accumulation steps).
    Buffers (the head's vocabulary mapping) are identical on every rank and are not broadcast.
    """
    if not env.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)


def shard_head(module: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """The place for FSDP2: shard a head too large to replicate on every rank.

    It would call ``torch.distributed.fsdp.fully_shard`` on ``module.midlayer`` and on the
    module itself over a 1-D device mesh of ``env.world_size`` ranks, after which parameters are
    ``DTensor`` shards; checkpoints would then go through ``torch.distributed.checkpoint``
    (``get_model_state_dict`` / ``get_optimizer_state_dict`` with full, CPU-offloaded state on
    rank 0) instead of the plain state dicts the trainer saves. Not wired: every head outrider
    trains fits one GPU with DDP, so this refuses rather than train with untested checkpoints.
    """
    raise UserError("FSDP2 sharding of the draft head is not available yet: train with DDP (the default)")
