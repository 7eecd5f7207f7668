"""Hardware profiles and weight precisions: the numbers the cost model reads about a machine.

Contract: a ``HardwareProfile`` is data (memory capacity and bandwidth, compute per precision,
interconnect kind and bandwidth, per-forward overheads, efficiencies), read from a built-in JSON
file (``outrider/plan/profiles/*.json``) or a user's file, validated field by field (a bad field is a
``UserError`` naming it). ``WEIGHT_FORMATS`` gives bytes per parameter *including* group scales;
``default_precision`` picks the precision a target ships in from its config.

Not done here: step costs (``cost_model``), fitting a profile to measurements (``calibrate``)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from outrider.errors import UserError
from outrider.fsutil import read_text
from outrider.models import ArchInfo

ACT_BYTES = 2  # activations, KV cache and AllReduce messages are bf16


# --------------------------------------------------------------------------------------------
# Weight formats
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFormat:
    """A weight storage format: bytes per parameter including its scales, and the matmul path."""

    name: str
    bytes_per_param: float
    compute: str  # "bf16" (weights widened to bf16 in the kernel) or "fp8" (fp8 tensor cores)


# INT4: 4 bits + one bf16 scale per group of g weights = 0.5 + 2/g bytes.
# FP8 (DeepSeek-V3 style): 1 byte + one fp32 scale per 128x128 block = 1 + 4/16384 bytes.
# MXFP4: 4 bits + one e8m0 (1 byte) scale per 32 weights = 0.5 + 1/32 bytes.
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 2.0, "bf16"),
    "fp16": WeightFormat("fp16", 2.0, "bf16"),
    "fp8": WeightFormat("fp8", 1.0 + 4.0 / (128 * 128), "fp8"),
    "int8": WeightFormat("int8", 1.0 + 2.0 / 128, "bf16"),
    "int4": WeightFormat("int4", 0.5 + 2.0 / 128, "bf16"),
    "int4-g128": WeightFormat("int4-g128", 0.5 + 2.0 / 128, "bf16"),
    "int4-g32": WeightFormat("int4-g32", 0.5 + 2.0 / 32, "bf16"),
    "mxfp4": WeightFormat("mxfp4", 0.5 + 1.0 / 32, "bf16"),  # OCP MX: 4-bit values, one 8-bit scale per 32
}


def weight_format(name: str) -> WeightFormat:
    key = name.strip().lower().replace("bfloat16", "bf16").replace("float16", "fp16")
    if key not in WEIGHT_FORMATS:
        raise UserError(f"unknown weight dtype '{name}': use one of {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[key]


@dataclass(frozen=True)
class Precision:
    """Storage of the routed experts and of every other weight (attention, dense, shared, lm_head)."""

    experts: WeightFormat
    other: WeightFormat

    @property
    def label(self) -> str:
        if self.experts == self.other:
            return self.other.name
        return f"{self.experts.name} experts / {self.other.name} other"


def parse_precision(spec: str) -> Precision:
    """``"fp8"`` sets every weight; ``"int4-g32/bf16"`` sets routed experts / everything else."""
    parts = [p for p in spec.split("/") if p.strip()]
    if len(parts) == 1:
        fmt = weight_format(parts[0])
        return Precision(fmt, fmt)
    if len(parts) == 2:
        return Precision(weight_format(parts[0]), weight_format(parts[1]))
    raise UserError(f"bad weight dtype '{spec}': give one dtype (e.g. bf16) or experts/other (e.g. int4-g32/bf16)")


def default_precision(arch: ArchInfo) -> Precision:
    """Guess the served precision from a config: quantised 4-bit MoE -> INT4 experts only."""
    q = arch.quantization.lower()
    bf16 = WEIGHT_FORMATS["bf16"]
    if "fp8" in q or "float8" in q:
        return Precision(WEIGHT_FORMATS["fp8"], WEIGHT_FORMATS["fp8"])
    if "int4" in q or "awq" in q or "gptq" in q:
        int4 = WEIGHT_FORMATS["int4"]
        return Precision(int4, bf16 if arch.is_moe else int4)
    return Precision(bf16, bf16)


# --------------------------------------------------------------------------------------------
# Hardware profiles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU model and how a serving engine uses it. Bandwidths and peaks are per GPU.

    ``memory_efficiency`` and ``compute_efficiency`` apply to the ceilings actually used: the
    measured ones where given, else the spec ones. ``link_bandwidth_bytes_per_s`` is per
    direction per GPU; ``link_latency_s`` is per ring hop (a ring AllReduce makes 2(tp-1) hops).
    ``step_overhead_s`` is paid once per target forward (scheduling, sampling, graph launch);
    ``layer_overhead_s`` once per decoder layer (+1 for embeddings/lm_head) of every forward,
    draft forwards included: the floor of small kernels that bandwidth alone does not explain.
    ``token_overhead_s`` is paid per new token of a target forward (n * b): host-side and
    elementwise work that grows with the tokens a step verifies (masks, sampling, acceptance).
    ``verify_overhead_s`` is paid once per verification step (n > 1): the host round trip that
    acceptance needs, which plain decoding avoids by running its steps back to back.
    """

    name: str
    description: str
    source: str
    memory_capacity_bytes: float
    memory_bandwidth_bytes_per_s: float
    bf16_flops_per_s: float
    interconnect: str  # "nvlink" | "pcie"
    link_bandwidth_bytes_per_s: float
    link_latency_s: float
    fp8_flops_per_s: float | None = None
    measured_memory_bandwidth_bytes_per_s: float | None = None
    measured_bf16_flops_per_s: float | None = None
    memory_efficiency: float = 0.85
    compute_efficiency: float = 0.7
    link_efficiency: float = 0.8
    step_overhead_s: float = 100e-6
    layer_overhead_s: float = 20e-6
    token_overhead_s: float = 0.0
    verify_overhead_s: float = 0.0
    collectives_per_layer: float = 2.0
    notes: str = ""

    @property
    def memory_ceiling_bytes_per_s(self) -> float:
        return self.measured_memory_bandwidth_bytes_per_s or self.memory_bandwidth_bytes_per_s

    def flops_ceiling_per_s(self, compute: str) -> float:
        """Matmul ceiling for ``"bf16"`` or ``"fp8"``; fp8 is scaled by the measured/spec bf16 ratio."""
        ratio = (self.measured_bf16_flops_per_s / self.bf16_flops_per_s) if self.measured_bf16_flops_per_s else 1.0
        if compute == "fp8" and self.fp8_flops_per_s:
            return self.fp8_flops_per_s * ratio
        return self.bf16_flops_per_s * ratio

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_REQUIRED = ("name", "memory_capacity_bytes", "memory_bandwidth_bytes_per_s", "bf16_flops_per_s",
             "interconnect", "link_bandwidth_bytes_per_s", "link_latency_s")
_FRACTIONS = ("memory_efficiency", "compute_efficiency", "link_efficiency")
_INTERCONNECTS = ("nvlink", "pcie")


def profile_from_dict(data: Any, origin: str = "hardware profile") -> HardwareProfile:
    """Validate a profile dict; every problem is a one-line ``UserError`` naming ``origin``."""
    if not isinstance(data, dict):
        raise UserError(f"{origin}: a hardware profile must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{origin}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(known))})")
    missing = [k for k in _REQUIRED if data.get(k) is None]
    if missing:
        raise UserError(f"{origin}: missing required key(s) {', '.join(missing)}")
    values: dict[str, Any] = {}
    for f in fields(HardwareProfile):
        if f.name not in data or data[f.name] is None:
            continue
        v = data[f.name]
        if f.name in ("name", "description", "source", "interconnect", "notes"):
            if not isinstance(v, str):
                raise UserError(f"{origin}: '{f.name}' must be a string")
            values[f.name] = v
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UserError(f"{origin}: '{f.name}' must be a number, got {v!r}")
        v = float(v)
        if f.name in _FRACTIONS and not 0 < v <= 1:
            raise UserError(f"{origin}: '{f.name}' must be in (0, 1], got {v}")
        if f.name in ("step_overhead_s", "layer_overhead_s", "token_overhead_s", "verify_overhead_s",
                      "link_latency_s"):
            if v < 0:
                raise UserError(f"{origin}: '{f.name}' must be >= 0, got {v}")
        elif v <= 0:
            raise UserError(f"{origin}: '{f.name}' must be > 0, got {v}")
        values[f.name] = v
    if values["interconnect"] not in _INTERCONNECTS:
        raise UserError(f"{origin}: 'interconnect' must be one of {', '.join(_INTERCONNECTS)}, got {values['interconnect']!r}")
    values.setdefault("description", values["name"])
    values.setdefault("source", "")
    return HardwareProfile(**values)


def builtin_profiles() -> list[str]:
    folder = resources.files("outrider.plan") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name (``h200``, ``h100``, ``b200``, ``rtx-pro-6000``) or a JSON file."""
    spec = str(name_or_path)
    path = Path(spec).expanduser()
    if spec.endswith(".json") or path.exists():
        if not path.is_file():
            raise UserError(f"hardware profile not found: {path} (give a built-in name: {', '.join(builtin_profiles())})")
        text, origin = _read_text(path), str(path)
    else:
        key = spec.strip().lower()
        if key not in builtin_profiles():
            raise UserError(f"unknown hardware '{spec}': use one of {', '.join(builtin_profiles())} or a profile .json file")
        text, origin = (resources.files("outrider.plan") / "profiles" / f"{key}.json").read_text(), f"built-in profile {key}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{origin} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return profile_from_dict(data, origin)


def _read_text(path: Path) -> str:
    try:
        return read_text(path)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e}") from None
