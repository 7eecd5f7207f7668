"""Dataclass configs: settings of a stage as plain, JSON-round-trippable values.

Contract:
- ``TrainConfig`` holds every setting of an EAGLE-3 training run (``outrider.train.loop.trainer``):
  the optimisation (AdamW, linear warmup then cosine decay to ``min_lr_ratio * lr``, gradient
  clipping, accumulation), the batch geometry, the training-time-test unroll, the draft
  vocabulary size, evaluation and checkpoint cadence, and the seed. ``preset(name)`` returns one
  of the named presets (``quick``: a few minutes on a 2-core CPU with the default model;
  ``full``: about ten minutes of training on one H200).
- ``to_dict`` / ``from_dict`` / ``save`` / ``load`` round-trip through JSON exactly;
  ``from_dict`` refuses unknown keys and bad values with a one-line ``UserError`` (a typo in a
  ``--config`` file must not be silently ignored). ``replace(**changes)`` returns a validated copy.
- Batch geometry: ``batch_size`` is per process and per micro-batch; one optimizer step sees
  ``batch_size * world_size * grad_accum`` sequences (the global batch), whatever the number
  of processes. With ``batch_tokens > 0`` a micro-batch is a budget of padded tokens per
  process instead (as many sequences as fit, counts rounded to few distinct shapes:
  ``TokenDataset.global_batches``); ``batch_size`` then only sets the evaluation batches. With
  ``min_batch_tokens > 0`` (batches by count, drawn by length; ignored with ``batch_tokens`` or
  without length grouping, which make their own batches) neighbouring batches of short sequences
  are joined until a batch holds that many padded tokens (steps too small to keep the GPU busy
  are what they remove); ``max_batch_tokens`` bounds a micro-batch's padded tokens.

Not done here: reading command-line flags (``outrider.cli``), choosing a preset from the hardware
(the trainer does), settings of stages other than training.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from dataclasses import replace as _dc_replace
from pathlib import Path
from typing import Any

from outrider.errors import UserError
from outrider.fsutil import atomic_write_json, read_json

PRESET_NAMES = ("quick", "full")
DRAFTERS = ("eagle3", "dflash")
DFLASH_LABELS = ("tokens", "target")  # what a DFlash draft learns: the sequence's token, or the target's distribution


@dataclass(frozen=True)
class TrainConfig:
    """Settings of an EAGLE-3 training run; every field is a JSON scalar or list."""

    steps: int = 300  # optimizer steps of the whole run (the schedule's horizon)
    batch_size: int = 4  # sequences per process per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    max_length: int = 1024  # tokens per sequence at training time (longer examples are cut)
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at `steps`
    warmup_steps: int = 20  # linear warmup from 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 0.5  # max global gradient norm; 0 disables clipping
    ttt_steps: int = 7  # training-time-test unroll length
    step_decay: float = 0.8  # loss weight of unroll step i is step_decay**i
    draft_vocab_size: int | None = 32000  # None = min(32000, target vocab); capped at the target's
    aux_layer_ids: tuple[int, ...] | None = None  # None = (2, L//2, L-3)
    tau_k: int = 5  # chain length of the simulated acceptance length that selects the best head
    eval_every: int = 100  # optimizer steps between evaluations (and at the end)
    eval_examples: int | None = 256  # eval conversations per evaluation; None = the whole eval split
    save_every: int = 100  # optimizer steps between checkpoints of the full state (and at the end)
    log_every: int = 1  # optimizer steps between lines of metrics.jsonl
    init_from_target: bool = False  # start lm_head (draft rows) and the final norm from the target's
    freeze_lm_head: bool = False  # keep lm_head as it starts (the target's rows; needs init_from_target), as DFlash's references do
    init_layer_from_target: bool = False  # start the draft layer from the target's last decoder layer (and fc
    # passing the last aux state through); needs the head's layer shapes to be the target's
    seed: int = 0  # head initialisation and data order
    amp: bool = True  # bf16 autocast of the head on CUDA (ignored on CPU, which trains in float32)
    compile: bool = True  # on CUDA, the TTT loss runs in fused kernels (ignored on CPU)
    loss_kernel: str = "triton"  # those kernels: "triton" (one pass over the logits) or "compile" (torch.compile)
    compile_head: bool = False  # on CUDA, the head's step around its attention runs torch.compile'd (ignored on CPU)
    time_budget_s: float = 0.0  # > 0: stop (final eval, checkpoint) after this much training; lr anneals by it
    group_by_length: int = 32  # > 1: batches drawn from windows of this many batches sorted by length (less padding)
    batch_tokens: int = 0  # > 0: a micro-batch is this many padded tokens per process, not batch_size sequences
    min_batch_tokens: int = 0  # > 0: short batches joined up to this many tokens (by count and by length only)
    graph_target: bool = False  # on CUDA, the target's forward replays a CUDA graph per batch shape (dense targets)
    ttt_attention: str = "dense"  # on CUDA, the unrolled steps' attention: "dense" (SDPA, block mask) or "flex"
    run_ahead: bool = True  # one process: the next step is queued before this one's metrics are read
    head_attention: str = "gqa"  # the head's attention: "gqa" (Llama) or "mla" (DeepSeek latent, the target's sizes)
    head_fc_norm: bool = False  # EAGLE 3.1: one RMSNorm per aux state before fc
    head_norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc (GQA heads)
    head_norm_output: bool = False  # EAGLE 3.1: the next step reads the normed output
    head_norm_before_residual: bool = False  # the residual is hidden_norm(h) (vLLM serves it, SGLang does not)
    head_sliding_window: int = 0  # > 0: the head attends to the last this many positions (GQA heads)
    parallel_drafting: bool = False  # P-EAGLE: train the head to draft all ttt_steps tokens in one forward
    mask_token_id: int | None = None  # its placeholder token; None: the tokenizer's pad, else unk, else eos token
    drafter: str = "eagle3"  # "eagle3" (the head, ttt_steps unrolled) or "dflash" (a block drafter, heads.dflash)
    block_size: int = 8  # dflash: positions per block, drafting block_size - 1 tokens per forward
    dflash_layers: int = 1  # dflash: the drafter's decoder layers
    dflash_kv_heads: int = 0  # dflash: key/value heads per layer (0: the target's; its attention heads: plain multi-head)
    loss_decay_gamma: float | None = None  # dflash: draft i weighs exp(-i/gamma); None: the paper's for the block
    num_anchors: int = 512  # dflash: blocks per sequence per training step (evaluation: every position)
    dflash_labels: str = "tokens"  # dflash: learn the sequence's tokens (the method's) or the "target"'s distribution

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(j) for j in self.aux_layer_ids))
        self.validate()

    def validate(self) -> None:
        positive = ("steps", "batch_size", "grad_accum", "ttt_steps", "tau_k", "eval_every", "save_every",
                    "log_every")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"training setting '{name}' must be a positive integer, got {value!r}")
        if not isinstance(self.max_length, int) or self.max_length < 8:
            raise UserError(f"training setting 'max_length' must be an integer >= 8, got {self.max_length!r}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps <= self.steps:
            raise UserError(f"training setting 'warmup_steps' must be in 0..steps ({self.steps}), "
                            f"got {self.warmup_steps!r}")
        if not self.lr > 0:
            raise UserError(f"training setting 'lr' must be positive, got {self.lr!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"training setting 'min_lr_ratio' must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.adam_eps <= 0:
            raise UserError("training settings 'weight_decay' and 'grad_clip' must be >= 0 and 'adam_eps' > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise UserError(f"training setting 'betas' must be two numbers in [0, 1), got {list(self.betas)}")
        if not 0.0 < self.step_decay <= 1.0:
            raise UserError(f"training setting 'step_decay' must be in (0, 1], got {self.step_decay!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise UserError(f"training setting 'draft_vocab_size' must be positive, got {self.draft_vocab_size!r}")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3 and self.drafter != "dflash":
            raise UserError(f"training setting 'aux_layer_ids' needs exactly 3 ids, got {list(self.aux_layer_ids)}")
        if isinstance(self.time_budget_s, bool) or not isinstance(self.time_budget_s, (int, float)) \
                or not self.time_budget_s >= 0:
            raise UserError(f"training setting 'time_budget_s' must be a number >= 0, got {self.time_budget_s!r}")
        if isinstance(self.group_by_length, bool) or not isinstance(self.group_by_length, int) \
                or self.group_by_length < 0:
            raise UserError(f"training setting 'group_by_length' must be an integer >= 0, got {self.group_by_length!r}")
        if isinstance(self.batch_tokens, bool) or not isinstance(self.batch_tokens, int) or self.batch_tokens < 0:
            raise UserError(f"training setting 'batch_tokens' must be an integer >= 0, got {self.batch_tokens!r}")
        if isinstance(self.min_batch_tokens, bool) or not isinstance(self.min_batch_tokens, int) \
                or self.min_batch_tokens < 0:
            raise UserError(f"training setting 'min_batch_tokens' must be an integer >= 0, "
                            f"got {self.min_batch_tokens!r}")
        if not isinstance(self.run_ahead, bool):
            raise UserError(f"training setting 'run_ahead' must be true or false, got {self.run_ahead!r}")
        if self.ttt_attention not in ("dense", "flex"):
            raise UserError(f"training setting 'ttt_attention' must be 'dense' or 'flex', got {self.ttt_attention!r}")
        if self.loss_kernel not in ("triton", "compile"):
            raise UserError(f"training setting 'loss_kernel' must be 'triton' or 'compile', got {self.loss_kernel!r}")
        if self.head_attention not in ("gqa", "mla"):
            raise UserError(f"training setting 'head_attention' must be 'gqa' or 'mla', got {self.head_attention!r}")
        for name in ("head_fc_norm", "head_norm_before_fc", "head_norm_output", "head_norm_before_residual"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"training setting '{name}' must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.head_sliding_window, bool) or not isinstance(self.head_sliding_window, int) \
                or self.head_sliding_window < 0:
            raise UserError(f"training setting 'head_sliding_window' must be an integer >= 0, "
                            f"got {self.head_sliding_window!r}")
        if not isinstance(self.parallel_drafting, bool):
            raise UserError(f"training setting 'parallel_drafting' must be true or false, got {self.parallel_drafting!r}")
        if self.mask_token_id is not None and (type(self.mask_token_id) is not int or self.mask_token_id < 0):
            raise UserError(f"training setting 'mask_token_id' must be a token id >= 0 or null, got {self.mask_token_id!r}")
        if self.drafter not in DRAFTERS:
            raise UserError(f"training setting 'drafter' must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        for name, least in (("block_size", 2), ("dflash_layers", 1), ("num_anchors", 1), ("dflash_kv_heads", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise UserError(f"training setting '{name}' must be an integer >= {least}, got {value!r}")
        if self.dflash_kv_heads and self.drafter != "dflash":
            raise UserError("training setting 'dflash_kv_heads' is a DFlash drafter's: drop it or train with "
                            "--drafter dflash")
        if self.loss_decay_gamma is not None and not (isinstance(self.loss_decay_gamma, (int, float))
                                                      and self.loss_decay_gamma > 0):
            raise UserError(f"training setting 'loss_decay_gamma' must be a positive number or null, "
                            f"got {self.loss_decay_gamma!r}")
        if not isinstance(self.freeze_lm_head, bool):
            raise UserError(f"training setting 'freeze_lm_head' must be true or false, got {self.freeze_lm_head!r}")
        if self.freeze_lm_head and not self.init_from_target:
            raise UserError("training setting 'freeze_lm_head' keeps the target's lm_head rows: set init_from_target too")
        if self.dflash_labels not in DFLASH_LABELS:
            raise UserError(f"training setting 'dflash_labels' must be one of {', '.join(DFLASH_LABELS)}, "
                            f"got {self.dflash_labels!r}")
        if self.dflash_labels != "tokens" and self.drafter != "dflash":
            raise UserError("training setting 'dflash_labels' is a DFlash drafter's (an EAGLE-3 head always learns "
                            "the target's distribution): drop it or train with --drafter dflash")
        if self.drafter == "dflash" and self.parallel_drafting:
            raise UserError("a DFlash drafter drafts its block in one forward already: drop parallel_drafting")
        if self.eval_examples is not None and self.eval_examples < 1:
            raise UserError(f"training setting 'eval_examples' must be positive or null, got {self.eval_examples!r}")

    @property
    def draft_steps(self) -> int:
        """Drafts per round the loss trains: ``ttt_steps`` (EAGLE-3), ``block_size - 1`` (DFlash)."""
        return self.block_size - 1 if self.drafter == "dflash" else self.ttt_steps

    def step_weights(self) -> list[float]:
        """Loss weight of draft i: ``step_decay**i`` (EAGLE-3), ``exp(-i / gamma)`` (DFlash; gamma by
        default the paper's 7, 5, 4 for blocks of 16, 10, 8, i.e. about ``block_size / 2``)."""
        if self.drafter != "dflash":
            return [self.step_decay ** i for i in range(self.ttt_steps)]
        gamma = self.loss_decay_gamma or {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, self.block_size / 2)
        return [math.exp(-i / gamma) for i in range(self.block_size - 1)]

    @property
    def max_batch_tokens(self) -> int:
        """The most padded tokens a micro-batch of one process can hold (``global_batches``' bounds)."""
        floor = 2 * self.min_batch_tokens if self.joins_batches else 0  # joined batches stay under twice the floor
        return max(self.batch_tokens, floor, self.batch_size * self.max_length)

    @property
    def joins_batches(self) -> bool:
        """Does ``min_batch_tokens`` apply (batches by count, drawn by length)?"""
        return self.min_batch_tokens > 0 and self.batch_tokens == 0 and self.group_by_length > 1

    # --- presets ------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> "TrainConfig":
        if name not in PRESETS:
            raise UserError(f"unknown training preset '{name}': use one of {', '.join(PRESET_NAMES)}")
        return PRESETS[name]

    # --- (de)serialisation --------------------------------------------------------------------

    def head_options(self) -> dict[str, Any]:
        """The head settings as ``Eagle3Config.for_target`` options (those not at their default)."""
        options = {"fc_norm": self.head_fc_norm, "norm_before_fc": self.head_norm_before_fc,
                   "norm_output": self.head_norm_output, "norm_before_residual": self.head_norm_before_residual,
                   "sliding_window": self.head_sliding_window, "parallel_drafting": self.parallel_drafting}
        out = {k: v for k, v in options.items() if v}
        if self.parallel_drafting and self.mask_token_id is not None:  # id 0 is a token: not filtered
            out["mask_token_id"] = self.mask_token_id
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        d["aux_layer_ids"] = None if self.aux_layer_ids is None else list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        if not isinstance(d, dict):
            raise UserError(f"a training config must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UserError(f"unknown training setting(s) {', '.join(unknown)}: known ones are "
                            f"{', '.join(sorted(names))}")
        try:
            return cls(**d)
        except TypeError as e:
            raise UserError(f"bad training config: {e}") from None

    def replace(self, **changes: Any) -> "TrainConfig":
        return _dc_replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        return cls.from_dict(read_settings(path))


PRESETS: dict[str, TrainConfig] = {
    # A 2-core CPU, the default model: about 10 minutes including the target's forward. Small
    # batches (at this budget more updates beat bigger ones), three unroll steps (steps 4+ add little
    # to tau at the accuracies a short run reaches), a 4k draft vocabulary (what such data holds).
    "quick": TrainConfig(
        steps=160, batch_size=2, grad_accum=1, max_length=384, lr=2e-3, min_lr_ratio=0.1, warmup_steps=8,
        grad_clip=0.5, ttt_steps=3, draft_vocab_size=4096, eval_every=80, eval_examples=16, save_every=80,
    ),
    # One GPU, the default model, ~10k regenerated exchanges: 64 sequences of <= 1024 tokens per
    # step, drawn by length, neighbouring batches joined up to 16,384 padded tokens; a stop at 8
    # minutes of training, which also paces the cosine (the step horizon is an upper bound). The loss
    # in the Triton kernels, the head's step compiled, the target's forward as a CUDA graph per batch
    # shape. Token-budget batches and the flex attention were tried and gave worse heads at this
    # budget (benchmarks/history/RESULTS-2026-12-04.md): they stay options.
    "full": TrainConfig(
        steps=6000, batch_size=64, grad_accum=1, max_length=1024, lr=8e-4, min_lr_ratio=0.05, warmup_steps=50,
        grad_clip=0.5, ttt_steps=7, draft_vocab_size=32000, eval_every=500, eval_examples=256, save_every=500,
        time_budget_s=480.0, compile_head=True, graph_target=True, min_batch_tokens=16384,
    ),
}


def read_settings(path: str | Path) -> Any:
    """The JSON of a settings file (the ``config`` object of an earlier run's ``train_config.json``)."""
    d = read_json(path, "training config")
    if isinstance(d, dict) and isinstance(d.get("config"), dict):  # a train_config.json of an earlier run
        d = d["config"]
    return d


def resolve_config(preset: str | None, config: "TrainConfig | str | None", device_type: str,
                   drafter: str | None = None) -> tuple["TrainConfig", str | None]:
    """The run's settings: a ``TrainConfig`` as given, or a preset (default ``full`` on CUDA, ``quick``
    elsewhere) overridden by a JSON file of settings (an earlier ``train_config.json`` works too);
    either then takes ``drafter`` (``--drafter``), before the settings are checked together: a file
    of a DFlash drafter's settings is valid with the flag alone."""
    if isinstance(config, TrainConfig):
        if preset is not None and config != TrainConfig.preset(preset):
            raise UserError("give either a preset or a TrainConfig, not both")
        return (config if drafter is None else config.replace(drafter=drafter)), preset
    name = preset or ("full" if device_type == "cuda" else "quick")
    base = TrainConfig.preset(name)
    if config is None:
        return (base if drafter is None else base.replace(drafter=drafter)), name
    p = Path(config).expanduser()
    overrides = read_settings(p)
    if not isinstance(overrides, dict):
        raise UserError(f"the training config {p} must be a JSON object of settings")
    merged = base.to_dict()
    unknown = sorted(set(overrides) - set(merged))
    if unknown:
        raise UserError(f"unknown training setting(s) {', '.join(unknown)} in {p}: known ones are "
                        f"{', '.join(sorted(merged))}")
    merged.update(overrides)
    if drafter is not None:
        merged["drafter"] = drafter
    return TrainConfig.from_dict(merged), name
