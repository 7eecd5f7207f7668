"""The options of a training run, typed once: ``TrainOptions`` (and ``StreamOptions``, which
``capture`` shares).

Contract: ``outrider.cliargs.train_options`` builds them from the command line and ``demo`` builds
them directly; ``outrider.train.loop.trainer.train`` takes them. Construction refuses what no run
can do (both or neither of ``data`` and ``cache``; streaming with a cache or a device map) with
the CLI's one-line ``UserError``. Nothing heavy is imported here.

Not done here: flag parsing (``outrider.cliargs``), the run's hyperparameters (``TrainConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from outrider.errors import UserError

if TYPE_CHECKING:
    from outrider.config import TrainConfig


@dataclass(frozen=True)
class StreamOptions:
    """``--stream-layers``: the target streamed layer by layer (``StreamedTarget``'s sizing)."""

    gpu_memory: float | None = None  # GB of device memory to use; None: what is free
    tokens_per_pass: int | None = None  # tokens per pass through the weights; None: the default
    max_chunk_tokens: int | None = None  # None: the streamer's default
    packing: str | None = None  # None: the streamer's default

    def as_kwargs(self) -> dict[str, Any]:
        """``StreamedTarget``'s keyword arguments (also the run's identity: the unset ones left out)."""
        out = {"gpu_memory": self.gpu_memory, "tokens_per_pass": self.tokens_per_pass}
        out.update({k: v for k, v in (("max_chunk_tokens", self.max_chunk_tokens), ("packing", self.packing))
                    if v is not None})
        return out


@dataclass(frozen=True)
class TrainOptions:
    """One training run: what it reads, where it writes, how the target is placed.

    preset:        ``quick`` or ``full``; default ``full`` on CUDA, ``quick`` on CPU
    config:        a ``TrainConfig``, or a JSON file of settings overriding the preset's
    init:          a head folder (any format ``load_head`` reads) or an earlier run's ``out`` to fine-tune
    resume:        continue the run in ``out/last`` exactly where it stopped
    max_steps:     stop at this optimizer step (the schedule still spans the config's ``steps``)
    aux_layer_ids: target layers whose input states the head fuses (default ``(2, L//2, L-3)``)
    cache:         a hidden-state cache (ours, SpecForge's or speculators'), instead of ``data``
    device_map:    place the target through accelerate (``models.parse_device_map``, offload into
                   ``offload_folder``); the head stays on ``device``
    stream:        stream the target layer by layer (``outrider.train.states.stream_train``)
    allow_change:  with ``resume``, what may differ from the checkpoint (``outrider.train.loop.resume.NAMES``)
    report_to:     also log the metrics to ``tensorboard`` or ``wandb`` (``outrider.train.loop.logs``)
    parallel_drafting: train a parallel-drafting head (P-EAGLE): sets the config's ``parallel_drafting``
    drafter:       ``"eagle3"`` or ``"dflash"`` (a DFlash block drafter): sets the config's ``drafter``; None keeps it
    """

    target: str
    data: str | None
    out: str
    cache: str | None = None
    preset: str | None = None
    config: TrainConfig | str | None = None
    init: str | None = None
    resume: bool = False
    device: Any = None  # torch.device or "cpu" / "cuda[:N]"; None: cuda when available
    dtype: Any = None  # torch.dtype or its name; None: fp32 on CPU, bf16 on GPU
    max_steps: int | None = None
    aux_layer_ids: Sequence[int] | None = None
    progress: bool = True
    device_map: str | dict | None = None
    offload_folder: str | None = None
    stream: StreamOptions | None = None
    allow_change: Sequence[str] = ()
    report_to: str = "none"
    parallel_drafting: bool = False
    drafter: str | None = None

    def __post_init__(self) -> None:
        if (self.data is None) == (self.cache is None):
            raise UserError("give either --data (a token dataset) or --cache (a hidden-state cache), not both")
        if self.stream is not None and (self.device_map is not None or self.cache is not None):
            raise UserError("--stream-layers streams the target from its files: drop --device-map and --cache")
