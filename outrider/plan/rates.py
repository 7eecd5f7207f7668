"""Rates and data behind the training plan and the batch model, each with its source.

Contract: ``RATES`` maps a name to a ``Rate``: a value, its unit, where it comes from and its
kind: ``measured`` (a run of ours: the record is named), ``estimate`` (an assumption until it is
measured; the plan prints it as "estimate, not measured") or ``formula`` (exact by construction).
Capture and cache throughputs are estimates until our own capture runs measure them: replacing one
is an edit of this table, or a user's JSON object ``{name: value}`` / ``{name: {"value": v,
"source": s}}`` through ``with_overrides``. ``LEARNING_CURVE`` holds held-out tau@5 of our heads
against the training tokens they had seen; ``ROW_SPREAD`` the per-prompt acceptance and reply
length of one batch-1 bench (how unlike each other the rows of a batch are).

Every measured figure here is of the default target (SmolLM2-135M, bf16) on one H200 unless its
source says otherwise. Not done here: fitting (``learning``), using the rates (``train_plan``,
``batching``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from outrider.errors import UserError
from outrider.fsutil import read_text

KINDS = ("measured", "estimate", "formula")


@dataclass(frozen=True)
class Rate:
    value: float
    unit: str
    source: str
    kind: str = "measured"

    @property
    def label(self) -> str:
        return "estimate, not measured" if self.kind == "estimate" else self.kind


_DATA12 = ("benchmarks/history/results/h200-data-12.json and h200-data-12-later.json: 10,011 + 11,701 replies regenerated in 130.2 + "
           "246.2 s (first and later exchanges, our engine, batch 64, CUDA graphs), at the kept examples' mean reply "
           "length (1,958,130 / 9,343 and 3,333,735 / 10,713 assistant tokens): 5,739,326 tokens; DESIGN.md: 21k "
           "examples in 6.6 min at commit 2bc1054")
_FULL_RUN = ("DESIGN.md, the `full` preset from a bare H200 at commit 2bc1054: 73.6 M tokens in 450 s of "
             "training, 163k tokens/s and MFU 16.6 % over the run (compilation and evaluations included)")

RATES: dict[str, Rate] = {
    "regen_tokens_per_s": Rate(15_250.0, "regenerated assistant tokens/s (default target, one H200)", _DATA12),
    "regen_batch": Rate(64, "sequences decoded together during regeneration", _DATA12),
    "regen_context": Rate(280, "mean tokens of context while a reply of that run was written",
                          "benchmarks/history/results/h200-data-12*.json: examples of 348 and 455 tokens, replies 60 % and 68 % of them"),
    "reply_share": Rate(0.60, "assistant (loss) tokens / all tokens of a regenerated exchange",
                        "benchmarks/history/results/h200-data-12.json: 1,958,130 loss tokens of 3,254,162 (first exchanges)"),
    "train_tokens_per_s_run": Rate(163_500.0, "training tokens/s over a whole run (default target, one H200)",
                                   _FULL_RUN),
    "train_mfu_run": Rate(0.166, "model FLOP utilisation over a whole run (989 TFLOP/s peak)", _FULL_RUN),
    "train_mfu_step": Rate(0.221, "median step's model FLOP utilisation (989 TFLOP/s peak)",
                           "benchmarks/history/results/h200-train-metrics-16.jsonl.gz through benchmarks/train_metrics.py: median "
                           "step 204,330 tokens/s, MFU 22.1 % (also the 2bc1054 run's median)"),
    "train_peak_flops_per_s": Rate(989e12, "FLOP/s the measured MFU is relative to (H200 dense bf16)",
                                   "outrider.train.loop.metrics.PEAK_BF16_FLOPS"),
    "eval_warmup_s": Rate(75.0, "seconds of compilation and graph capture before a bench's timed passes",
                          "benchmarks/history/results/h200-bench-17-clean30v3-{a,b}.json: bench stages of 113 s (fresh machine) and 74 s "
                          "(second process) around ~25 s of passes; RESULTS.md: 45-106 s per engine across builds"),
    "eval_ar_tokens_per_s": Rate(735.0, "plain decoding tokens/s of our engine on the default target at batch 1 "
                                 "(one H200, compiled, prompt forward included)",
                                 "benchmarks/history/results/h200-bench-17-clean30v3-a.json: ar_tokens_per_s 734.7"),
    "capture_compute_efficiency": Rate(0.4, "share of the matmul ceiling a target forward over many tokens reaches",
                                       "assumed for stock transformers modules at prefill-sized batches",
                                       "estimate"),
    "stream_bytes_per_s": Rate(5e9, "bytes/s of weights one layer-streamed rank reads into its GPU",
                               "assumed: one NVMe SSD or the page cache through pageable copies", "estimate"),
    "storage_read_bytes_per_s": Rate(5e9, "bytes/s the host's storage delivers to all streamed ranks together",
                                     "assumed: one NVMe SSD", "estimate"),
    "host_memory_bytes": Rate(2e12, "host memory of the GPU node: the page cache that keeps a streamed checkpoint",
                              "assumed: 2 TB, common for 8-GPU H100/H200 nodes", "estimate"),
    "disk_write_bytes_per_s": Rate(2e9, "bytes/s written to the hidden-state cache", "assumed: one NVMe SSD",
                                   "estimate"),
    "disk_read_bytes_per_s": Rate(3e9, "bytes/s read back from the hidden-state cache", "assumed: one NVMe SSD",
                                  "estimate"),
    "served_prefill_efficiency": Rate(0.4, "share of the matmul ceiling a serving engine's prefill reaches",
                                      "assumed", "estimate"),
    "served_batch": Rate(64, "concurrent requests a server decodes during regeneration", "assumed", "estimate"),
    "server_start_s": Rate(600.0, "seconds to start a server and load a large target",
                           "assumed (weights read once from local NVMe)", "estimate"),
    "token_bytes": Rate(5.0, "bytes per token of a token dataset before compression (int32 id + int8 mask)",
                        "outrider.train.data.datasets: input_ids list<int32>, loss_mask list<int8>", "formula"),
}


def with_overrides(overrides: Mapping[str, Any] | str | Path | None, origin: str = "rates") -> dict[str, Rate]:
    """``RATES`` with a user's values: a mapping or a JSON file of ``{name: value}`` or
    ``{name: {"value": v, "source": s}}``; an overridden rate becomes ``measured`` by the user."""
    table = dict(RATES)
    if overrides is None:
        return table
    if isinstance(overrides, (str, Path)):
        path = Path(overrides).expanduser()
        origin = str(path)
        try:
            overrides = json.loads(read_text(path))
        except OSError as e:
            raise UserError(f"cannot read rates file {path}: {e}") from None
        except json.JSONDecodeError as e:
            raise UserError(f"rates file {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(overrides, Mapping):
        raise UserError(f"{origin}: rates must be a JSON object of name -> value")
    for name, v in overrides.items():
        if name not in table:
            raise UserError(f"{origin}: unknown rate '{name}' (known: {', '.join(sorted(table))})")
        source = f"{origin} (given)"
        if isinstance(v, Mapping):
            source, v = str(v.get("source", source)), v.get("value")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise UserError(f"{origin}: rate '{name}' must be a positive number, got {v!r}")
        table[name] = replace(table[name], value=float(v), source=source, kind="measured")
    return table


@dataclass(frozen=True)
class CurvePoint:
    tokens: float  # training tokens the head had seen (sequence tokens, over all passes)
    tau: float  # held-out tau at k = 5, bonus token included
    source: str


_LINEAGE = ("a head trained from scratch, then trained on in four further runs on data that grew from "
            "7.5 M to 18.4 M distinct tokens")
LEARNING_CURVE: tuple[CurvePoint, ...] = (
    CurvePoint(36.8e6, 2.18, "benchmarks/history/results/cpu-bench-eagle3-head11.json (from scratch, first exchanges only, float32, "
                             "10 held-out prompts)"),
    CurvePoint(58.1e6, 2.31, f"benchmarks/history/results/cpu-bench-eagle3-head12.json ({_LINEAGE}; float32, 10 held-out prompts)"),
    CurvePoint(73.6e6, 2.69, "DESIGN.md: the `full` preset at 2bc1054, from scratch (bf16, 30 held-out prompts)"),
    CurvePoint(121.7e6, 2.71, "benchmarks/history/results/cpu-bench-eagle3-head13.json (float32, 10 held-out prompts)"),
    CurvePoint(121.7e6, 2.65, "benchmarks/history/results/h200-bench-13-static.json (bf16, the same 10 prompts)"),
    CurvePoint(186.8e6, 2.92, "benchmarks/history/results/cpu-bench-eagle3-head14.json (float32, 10 held-out prompts)"),
    CurvePoint(272.0e6, 2.93, "benchmarks/history/results/cpu-bench-eagle3-head15.json (float32, 10 held-out prompts)"),
    CurvePoint(272.0e6, 2.97, "benchmarks/history/results/cpu-walk-check-15-head15-30.json (float32, 30 held-out prompts)"),
    CurvePoint(364.3e6, 2.98, "benchmarks/history/results/cpu-bench-eagle3-head16-v3-30.json (float32, 30 prompts free of training "
                              "text)"),
    CurvePoint(364.3e6, 3.08, "benchmarks/history/results/h200-bench-17-clean30v3-a.json (bf16, the same 30 prompts)"),
    CurvePoint(364.3e6, 3.11, "benchmarks/history/results/cpu-bench-eagle3-head16.json (float32, 10 held-out prompts)"),
)
CURVE_NOTE = ("held-out tau@5 of EAGLE-3 heads on SmolLM2-135M (hidden 576) against the tokens they had trained "
              "on, 6-20 passes over 3.4-18.4 M distinct tokens; the shape transfers to other targets more than "
              "the level does")

# One batch-1 bench: per prompt, its tau and its verify steps (k = 5, 128 new tokens at most), so that
# a row's reply length is about tau x steps. Source: benchmarks/history/results/h200-bench-17-clean30v3-a.json.
ROW_SPREAD_SOURCE = "benchmarks/history/results/h200-bench-17-clean30v3-a.json (30 held-out prompts, k = 5, batch 1, bf16)"
ROW_SPREAD_K = 5
ROW_SPREAD_MAX_NEW = 128
ROW_SPREAD_RATES = (0.6816, 0.4910, 0.3673, 0.3024, 0.2415)  # accept_rate_per_pos of that record
ROW_SPREAD_TAU = (2.75, 3.098, 2.667, 3.909, 2.276, 4.161, 3.385, 2.15, 2.911, 5.417, 5.417, 4.0, 4.0, 2.203,
                  2.133, 5.0, 3.037, 3.25, 2.455, 1.812, 1.562, 2.75, 5.417, 2.667, 3.098, 3.528, 3.047, 3.4,
                  2.592, 3.333)
ROW_SPREAD_STEPS = (8, 41, 9, 33, 58, 31, 39, 40, 45, 24, 24, 4, 33, 59, 60, 26, 27, 40, 44, 16, 32, 24, 24, 48,
                    41, 36, 43, 5, 49, 39)
