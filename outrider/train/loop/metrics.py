"""Training metrics: per-step sums read back without stalling the device, and the run's report.

Contract: ``StepSums`` accumulates a step's (or an evaluation's) per-unroll-step soft
cross-entropy, argmax agreements and loss positions on the device and reads them back in one host
round trip behind the work they belong to (``HostCopy``: pinned memory and an event, so the host
does not wait for steps queued after it); ``reduce`` sums them over ranks. ``metrics`` gives the
loss, per-step accuracy and the simulated acceptance length ``tau_at`` (a chain of k drafts
yields ``1 + sum_{j<=k} prod_{i<=j} acc_i`` tokens per round). ``TrainReport`` is what ``train``
returns and prints. ``peak_flops`` names the bf16 peak MFU is counted against. ``summarise_log`` reads a run's
``metrics.jsonl`` back into the figures RESULTS.md reports (``benchmarks/train_metrics.py`` prints them).

Not done here: logging to files (``checkpoint``), the FLOPs themselves (``flops``).
"""

from __future__ import annotations

import collections
import gzip
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from outrider.errors import UserError
from outrider.train.loop import dist

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, per GPU


@dataclass
class TrainReport:
    out: str
    head_dir: str
    preset: str | None
    steps: int  # optimizer steps done in total (including resumed ones)
    schedule_steps: int  # the schedule's horizon (config ``steps``)
    best_step: int
    best_sim_tau: float  # simulated acceptance length at ``tau_k`` drafts of the saved head
    tau_k: int
    final_eval: dict[str, Any]  # the last evaluation's metrics (empty without an eval split)
    train_tokens: int  # real tokens seen by this run (all ranks, resumed part excluded)
    wall_s: float  # this invocation, loading included
    train_s: float  # time inside optimizer steps (capture, TTT, backward, update)
    tokens_per_s: float  # train_tokens / train_s, the target's forward included
    mfu: float | None
    mfu_note: str
    world_size: int
    global_batch: int  # sequences per optimizer step, at least with min_batch_tokens (0: counted in tokens)
    global_batch_tokens: int  # padded tokens per optimizer step at most (0 when batches count sequences)
    device: str
    draft_vocab_size: int
    vocab_coverage: float  # share of the training data's loss tokens the draft vocabulary covers
    resumed_from: int | None = None
    rank: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _batch_words(self) -> str:
        return f"{self.global_batch_tokens} padded tokens" if self.global_batch_tokens else str(self.global_batch)

    def summary(self) -> str:
        lines = [f"trained {self.steps}/{self.schedule_steps} steps on {self.device} x{self.world_size} "
                 f"(global batch {self._batch_words()}, preset {self.preset or 'custom'})"
                 + (f", resumed from step {self.resumed_from}" if self.resumed_from is not None else "")]
        lines.append(f"best head: {self.head_dir} (step {self.best_step}, simulated tau@{self.tau_k} "
                     f"{self.best_sim_tau:.3f})")
        if self.final_eval:
            acc = ", ".join(f"{a:.2f}" for a in self.final_eval.get("per_step_acc", []))
            lines.append(f"final eval: loss {self.final_eval['loss']:.4f}, accuracy per step [{acc}], "
                         f"simulated tau@{self.tau_k} {self.final_eval['sim_tau_k']:.3f}"
                         + (f", walked {self.final_eval['walk_tau_k']:.3f}" if "walk_tau_k" in self.final_eval else ""))
        mfu = f", MFU {100 * self.mfu:.1f}%" if self.mfu is not None else f" ({self.mfu_note})"
        lines.append(f"{self.train_tokens} tokens in {self.train_s:.0f} s of training ({self.wall_s:.0f} s in all): "
                     f"{self.tokens_per_s:.0f} tokens/s including the target's forward{mfu}")
        lines.append(f"draft vocabulary {self.draft_vocab_size} tokens, covering {100 * self.vocab_coverage:.1f}% "
                     "of the training loss tokens")
        lines.extend(self.notes)
        return "\n".join(lines)


def tau_at(acc: Sequence[float], k: int) -> float:
    """Simulated acceptance length of a chain of ``k`` drafts: ``1 + sum_{j<=k} prod_{i<=j} acc_i``."""
    total, run = 1.0, 1.0
    for a in list(acc)[:k]:
        run *= float(a)
        total += run
    return total


class HostCopy:
    """Device tensors copied to pinned host memory behind the work queued so far: ``get`` waits for
    that work only, not for what the host queued after it (a plain ``.cpu()`` waits for it all)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.sizes = [t.numel() for t in tensors]
        flat = (torch.cat([t.detach().reshape(-1).double() for t in tensors]) if tensors
                else torch.zeros(0, dtype=torch.float64))  # [sum of sizes]
        self.event = None
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat

    def get(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return list(self.host.split(self.sizes))


class StepSums:
    """Per-step sums over a batch (all micro-batches; all ranks after ``reduce``)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.ce = torch.zeros(steps, dtype=torch.float64)  # [steps] summed soft cross-entropy
        self.correct = torch.zeros(steps, dtype=torch.long)  # [steps] argmax agreements
        self.counted = torch.zeros(steps, dtype=torch.long)  # [steps] loss positions
        self.tokens = 0  # real tokens
        self.walk = torch.zeros(2, dtype=torch.long)  # [tokens, rounds] of walked decoding (eval only)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # device-side, not yet read
        self._staged: HostCopy | None = None  # the pending values (and extras) on their way to the host
        self.extra: list[torch.Tensor] = []  # the ``stage`` extras, once read

    def add(self, out, tokens: int) -> None:
        """Counts now; the device-side metrics are read when first needed (one host round trip)."""
        self._pending.append((out.per_step_loss, out.per_step_correct, out.per_step_tokens))
        self.counted += out.per_step_tokens
        self.tokens += int(tokens)

    def stage(self, *extra: torch.Tensor) -> None:
        """Starts the copy of the pending device values and ``extra`` to the host, without waiting."""
        self._staged = HostCopy([t for loss, correct, _ in self._pending for t in (loss, correct)] + list(extra))

    def _read(self) -> None:
        if self._staged is None and self._pending:
            self.stage()
        if self._staged is not None:
            values = self._staged.get()
            for j, (_, _, n) in enumerate(self._pending):
                self.ce += values[2 * j] * n.double()
                self.correct += values[2 * j + 1].round().long()
            self.extra = values[2 * len(self._pending):]
        self._pending, self._staged = [], None

    def merge(self, other: "StepSums") -> None:
        self._read()
        other._read()
        self.ce += other.ce
        self.walk += other.walk
        self.correct += other.correct
        self.counted += other.counted
        self.tokens += other.tokens

    def reduce(self, env: dist.DistEnv) -> None:
        self._read()
        packed = torch.cat([self.ce, self.correct.double(), self.counted.double(),
                            torch.tensor([float(self.tokens)], dtype=torch.float64), self.walk.double()])
        dist.all_reduce_sum(packed, env)
        s = self.steps
        self.ce = packed[:s]
        self.correct = packed[s:2 * s].round().long()
        self.counted = packed[2 * s:3 * s].round().long()
        self.tokens = int(packed[3 * s].round())
        self.walk = packed[3 * s + 1:].round().long()

    def state(self) -> dict[str, Any]:
        """The sums for a checkpoint (read on the host)."""
        self._read()
        return {"ce": self.ce, "correct": self.correct, "counted": self.counted, "tokens": self.tokens}

    def load_state(self, w: dict[str, Any]) -> None:
        self.ce, self.correct, self.counted, self.tokens = w["ce"], w["correct"], w["counted"], int(w["tokens"])

    def metrics(self, weights: Sequence[float], tau_k: int) -> dict[str, Any]:
        self._read()
        n = self.counted.clamp_min(1).double()
        per_step_loss = (self.ce / n).tolist()
        acc = (self.correct.double() / n).tolist()
        return {
            "loss": float(sum(w * loss for w, loss in zip(weights, per_step_loss))),
            "per_step_loss": [round(x, 6) for x in per_step_loss],
            "per_step_acc": [round(x, 6) for x in acc],
            "sim_tau": round(tau_at(acc, len(acc)), 6),
            "sim_tau_k": round(tau_at(acc, tau_k), 6),
            **({"walk_tau_k": round(int(self.walk[0]) / int(self.walk[1]), 6)} if int(self.walk[1]) else {}),
            "positions": int(self.counted[0]),
            "tokens": self.tokens,
        }


class Throughput:
    """One run's training seconds, tokens and FLOPs (resumed time not included), and each step's
    rates: tokens per second and, where the device's peak is known, MFU. A step's seconds are the
    host's between reads: where a launch runs the step (the CPU) a step queued ahead is counted in
    the step before, so ``recent()`` pools the last ``window`` steps."""

    def __init__(self, peak: float | None, world_size: int, window: int = 20):
        self.peak, self.world_size = peak, world_size
        self.train_s, self.tokens, self.flops = 0.0, 0, 0.0
        self.last: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)  # (tokens, seconds)

    def add(self, m: dict[str, Any], dt: float, weights: float, attention: float, total_s: float) -> None:
        """Counts a step of ``dt`` seconds and writes its rates into its metrics ``m``; ``total_s``: the
        run's training seconds so far, resumed ones included."""
        self.train_s += dt
        self.tokens += m["tokens"]
        self.last.append((m["tokens"], dt))
        self.flops += weights + attention
        m["tokens_per_s"], m["train_s"] = round(m["tokens"] / dt, 2), round(total_s, 3)
        if self.peak:
            m["mfu"] = round((weights + attention) / (dt * self.peak * self.world_size), 5)
            m["mfu_weights"] = round(weights / (dt * self.peak * self.world_size), 5)

    def mfu(self) -> float | None:
        return self.flops / (self.train_s * self.peak * self.world_size) if self.peak and self.train_s > 0 else None

    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s > 0 else 0.0

    def recent(self) -> float:
        """Tokens per second over the last ``window`` steps (what a progress bar shows)."""
        seconds = sum(dt for _, dt in self.last)
        return sum(n for n, _ in self.last) / seconds if seconds > 0 else 0.0


@dataclass
class Launched:
    """An optimizer step queued on the device, its metrics not yet read."""

    sums: StepSums
    counted: torch.Tensor  # [steps] loss positions of the global batch
    pairs: int  # causal attention pairs of the global batch
    lr: float
    epoch: int
    t0: float  # perf_counter when the host began to queue it
    ahead: bool = False  # queued before the step before it was read


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "MFU is reported on CUDA only"
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in name:
            return peak, f"peak {peak / 1e12:.0f} TFLOP/s bf16 ({name})"
    return None, f"MFU skipped: the bf16 peak of '{name}' is not known"


# A step's time is its tokens over its tokens/s, as the trainer measured it (from the end of the step
# before as the host saw it): with steps queued ahead the time-weighted steady figure is the sound one.
BUCKETS = (0, 8_000, 10_000, 12_000, 14_000, 20_000, 30_000)


def _time(r: dict) -> float:
    return r["tokens"] / r["tokens_per_s"]


def _weighted(rows: list[dict], key: str) -> float:
    total = sum(_time(r) for r in rows)
    return sum(r.get(key, 0.0) * _time(r) for r in rows) / total if total else 0.0


def summarise_log(path: str | Path, after: int = 100) -> dict:
    """A ``metrics.jsonl`` (or ``.gz``) in figures: the median step, the steady steps after ``after``
    (MFU weighted by each step's time), the steady steps by tokens per step, the evaluations."""
    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode()
    rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    train = [r for r in rows if r.get("type") == "train"]
    if len(train) <= after:
        raise UserError(f"{path}: {len(train)} training steps, not more than --after {after}")
    steady = train[after:]
    out = {
        "file": str(path), "steps": len(train), "step_time_s": round(sum(_time(r) for r in train), 1),
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in train)),
        "median_mfu": round(statistics.median(r.get("mfu", 0.0) for r in train), 4),
        "median_mfu_weights": round(statistics.median(r.get("mfu_weights", r.get("mfu", 0.0)) for r in train), 4),
        "share_at_20pct": round(sum(r.get("mfu", 0.0) >= 0.2 for r in train) / len(train), 3),
        "median_tokens_per_step": round(statistics.median(r["tokens"] for r in train)),
        "steady": {"after_step": after, "time_s": round(sum(_time(r) for r in steady), 1),
                   "mfu": round(_weighted(steady, "mfu"), 5),
                   "tokens_per_s": round(sum(r["tokens"] for r in steady) / sum(_time(r) for r in steady)),
                   "ahead_share": round(sum(bool(r.get("ahead")) for r in steady) / len(steady), 3)},
        "by_tokens": [], "evals": [],
    }
    edges = list(BUCKETS) + [float("inf")]
    for lo, hi in zip(edges, edges[1:]):
        part = [r for r in steady if lo <= r["tokens"] < hi]
        if part:
            out["by_tokens"].append({"from": lo, "to": None if hi == float("inf") else hi, "steps": len(part),
                                     "mfu": round(_weighted(part, "mfu"), 5),
                                     "median_ms": round(1e3 * statistics.median(_time(r) for r in part), 1)})
    seen = 0
    for r in rows:
        if r.get("type") == "train":
            seen += r["tokens"]
        elif r.get("type") == "eval":
            out["evals"].append({"step": r["step"], "tokens_m": round(seen / 1e6, 1), "sim_tau": r.get("sim_tau_k"),
                                 "walk_tau": r.get("walk_tau_k"), "acc0": (r.get("per_step_acc") or [None])[0]})
    return out
