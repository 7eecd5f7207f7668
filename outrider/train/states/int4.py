"""INT4 weights as compressed-tensors ships them (``pack-quantized``, Kimi-K2.5's routed experts).

Contract:
- ``Int4Scheme.from_config(quantization_config)`` reads a checkpoint's ``quantization_config``
  and accepts only what ``dequant_int4`` reproduces: ``quant_method: compressed-tensors``,
  ``format: pack-quantized``, 4-bit ``int`` weights, ``strategy: group`` (or ``channel``),
  symmetric or with zero points. Anything else is a one-line ``UserError``.
- A quantized ``nn.Linear`` ``<mod>`` is stored as ``<mod>.weight_packed`` int32 ``[out, in/8]``
  (8 values per word, element ``j`` in word ``j // 8`` at bits ``4*(j % 8)``, offset binary:
  nibble = q + 8, q in [-8, 7]), ``<mod>.weight_scale`` ``[out, in/G]`` in the weight's dtype,
  ``<mod>.weight_shape`` int64 ``[out, in]``, and for asymmetric schemes
  ``<mod>.weight_zero_point`` int32 ``[ceil(out/8), in/G]`` packed the same way along rows.
- ``dequant_int4`` returns ``(q - zp) * scale`` computed **in the scale's dtype** and then cast,
  which is what compressed-tensors' own decompressor and transformers' ``dequantize=True``
  loading compute: bit-identical to them (tested against the library). It works on any device and
  on stacked ``[..., out, in/8]`` inputs (several experts at once).

Not done here: other bit widths or formats (FP8 blocks, NVFP4, marlin-24), activation quantization,
quantized matmuls (weights are dequantized to a dense dtype before use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from outrider.errors import UserError

PACKED, SCALE, SHAPE, ZERO = "weight_packed", "weight_scale", "weight_shape", "weight_zero_point"


@dataclass(frozen=True)
class Int4Scheme:
    """The supported subset of a compressed-tensors weight scheme."""

    group_size: int  # 0: one scale per output channel
    symmetric: bool

    @classmethod
    def from_config(cls, qc: dict[str, Any] | None) -> "Int4Scheme | None":
        """``None`` for an unquantized checkpoint; the scheme for pack-quantized INT4; else ``UserError``."""
        if not qc:
            return None
        method = qc.get("quant_method")
        if method != "compressed-tensors":
            raise UserError(f"the checkpoint is quantized with '{method}': layer streaming reads unquantized "
                            "weights and compressed-tensors pack-quantized INT4 only")
        fmt = qc.get("format")
        groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        schemes = {(str(g.get("format") or fmt),) + _weight_key(g.get("weights") or {}) for g in groups}
        if len(schemes) != 1:
            raise UserError(f"the checkpoint mixes {len(schemes)} quantization schemes: layer streaming reads one "
                            "compressed-tensors pack-quantized INT4 scheme")
        form, bits, kind, strategy, group, symmetric = schemes.pop()
        if (form, bits, kind) != ("pack-quantized", 4, "int") or strategy not in ("group", "channel"):
            raise UserError(f"unsupported compressed-tensors scheme (format {form}, {bits}-bit {kind}, strategy "
                            f"{strategy}): layer streaming reads pack-quantized 4-bit int weights by group or channel")
        return cls(group_size=int(group or 0) if strategy == "group" else 0, symmetric=bool(symmetric))


def _weight_key(w: dict[str, Any]) -> tuple:
    return (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("group_size"), w.get("symmetric", True))


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 ``[..., rows, ceil(cols/8)]`` -> int8 ``[..., rows, cols]`` with values in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # [8]
    nibbles = packed.unsqueeze(-1) >> shifts  # [..., rows, cols/8, 8] int32, the only 4-byte temporary
    nibbles &= 0xF  # the sign bits of the arithmetic shift are masked away
    q = nibbles.to(torch.int8).flatten(-2)  # [..., rows, 8*ceil(cols/8)]
    q -= 8
    return q if q.shape[-1] == cols else q[..., :cols]


def unpack_int4_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero points packed along dim 0: int32 ``[ceil(rows/8), cols]`` -> int8 ``[rows, cols]``."""
    return unpack_int4(packed.t(), rows).t()


def dequant_int4(packed: torch.Tensor, scale: torch.Tensor, cols: int, zero_point: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """packed int32 ``[..., out, in/8]``, scale ``[..., out, in/G]`` (G = in for per-channel),
    zero_point (already unpacked) ``[..., out, in/G]`` -> weight ``[..., out, in]`` in ``dtype``
    (default: the scale's), the arithmetic in the scale's dtype."""
    q = unpack_int4(packed, cols).to(scale.dtype)  # [..., out, in]
    w = q.unflatten(-1, (scale.shape[-1], -1))  # [..., out, in/G, G]
    if zero_point is not None:
        w = w - zero_point.to(scale.dtype).unsqueeze(-1)
    w = (w * scale.unsqueeze(-1)).flatten(-2)  # [..., out, in]
    return w if dtype is None or w.dtype == dtype else w.to(dtype)
