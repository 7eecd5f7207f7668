"""The working set of a layer step, measured: bytes of tensors alive at once, counted at the dispatcher.

Contract:
- ``LiveBytes(device)`` is a ``TorchDispatchMode`` that adds up the storage bytes of every tensor an
  op returns on that device type (a storage counted once, views included; a module emptied to the
  meta device is not a CPU module's memory) until the storage is freed, and keeps the peak,
  overall and per phase (``phase(name)`` marks the module running: forward hooks on a layer's
  ``self_attn`` and ``mlp``). Storages that exist before it starts (weights, inputs) are not
  counted. It sees the thread it runs in only, on any device, the meta device included (no memory;
  ``aten._grouped_mm``, whose meta kernel takes bf16 only, is given its output's shape there).
- ``measure_working_set(step, layer, make_input, widths)``: runs ``step(layer, h, width)`` on
  inputs of one row of each width, and fits per phase ``per_token * T + per_key * T * w`` at or
  above every peak (``memory_plan.WorkingSet``).
- ``measure_decoder(config, decoder, dtype, layer_step, attention)``: that for every distinct layer
  shape of a decoder on the meta device (shapes only, nothing loaded), with its causal mask
  materialised (one padded key; built on the CPU, its values decide its form) and the final norm;
  phase by phase the largest. SDPA on the meta device takes its math path (the scores of every head
  materialised in float32: the most any of its kernels allocates), ``attention="math"``;
  ``"fused"`` prices SDPA as CUDA's fused kernels allocate (the output, the float32 log-sum-exp,
  the boolean mask turned into the query's dtype), a tighter figure that holds only where such a
  kernel runs.

Not done here: the allocator's rounding and fragmentation or a kernel's private workspace (the
plan's reserve covers them), choosing chunks (``stream``, ``memory_plan``).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from outrider.memory_plan import Phase, WorkingSet


def _grouped_mm_meta(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, *rest, **kw) -> torch.Tensor:
    """The output of ``aten._grouped_mm`` for a 2-D ``a`` [S, K] and a 3-D ``b`` [E, K, N]: [S, N]. The
    meta kernel accepts bf16 only; a float32 target's layers are measured through this."""
    out_dtype = kw.get("out_dtype") or a.dtype
    return torch.empty(a.shape[0], b.shape[-1], dtype=out_dtype, device="meta")


_META_SHIMS = {torch.ops.aten._grouped_mm.default: _grouped_mm_meta}


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the tensors ops return (see the module docstring)."""

    def __init__(self, device: torch.device | str, exclude: Sequence[torch.Tensor] = ()):
        super().__init__()
        self.device = torch.device(device).type
        self.live = 0
        self.peak = 0
        self.phase_name = "rest"
        self.phase_peaks: dict[str, int] = {}
        self._counted: set[int] = {t.untyped_storage()._cdata for t in exclude}
        self._excluded = set(self._counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shim = _META_SHIMS.get(func)
        meta = shim is not None and all(t.device.type == "meta" for t in tree_flatten((args, kwargs))[0]
                                        if isinstance(t, torch.Tensor))
        out = shim(*args, **kwargs) if meta else func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._counted:
            return
        n = storage.nbytes()
        self._counted.add(key)
        self.live += n
        weakref.finalize(storage, self._freed, key, n)
        self.peak = max(self.peak, self.live)
        self.phase_peaks[self.phase_name] = max(self.phase_peaks.get(self.phase_name, 0), self.live)

    def _freed(self, key: int, n: int) -> None:
        if key in self._counted and key not in self._excluded:
            self._counted.discard(key)
            self.live -= n

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before, self.phase_name = self.phase_name, name
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.live)
        try:
            yield
        finally:
            self.phase_name = before


@contextmanager
def phases(layer: torch.nn.Module, meter: LiveBytes) -> Iterator[None]:
    """Mark the layer's ``self_attn`` and ``mlp`` forwards as phases of ``meter``."""
    handles, open_ = [], {}
    for name in ("self_attn", "mlp"):
        module = getattr(layer, name, None)
        if module is None:
            continue

        def pre(_m, _a, name=name):
            open_[name] = meter.phase({"self_attn": "attention"}.get(name, name))
            open_[name].__enter__()

        def post(_m, _a, _o, name=name):
            open_.pop(name).__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def measure_step(step: Callable[[torch.nn.Module, torch.Tensor, int], object], layer: torch.nn.Module,
                 h: torch.Tensor, width: int, exclude: Sequence[torch.Tensor] = ()) -> dict[str, int]:
    """Peak live bytes per phase of ``step(layer, h, width)``; ``h`` [rows, width, H] and the layer's
    tensors are not counted."""
    keep = [*exclude, h, *layer.parameters(), *layer.buffers()]
    meter = LiveBytes(h.device, keep)
    with phases(layer, meter), meter:
        out = step(layer, h, width)
    del out
    return dict(meter.phase_peaks)


def measure_working_set(step: Callable[[torch.nn.Module, torch.Tensor, int], object], layer: torch.nn.Module,
                        make_input: Callable[[int], torch.Tensor], widths: Sequence[int] = (128, 512, 2048),
                        exclude: Sequence[torch.Tensor] = ()) -> WorkingSet:
    """Per phase, ``per_key``: the steepest growth of bytes per token between consecutive widths (one
    row each, so ``T = w``); ``per_token``: the least that puts ``per_token + per_key * w`` at or above
    every probe. The peak per token is a maximum of lines in ``w`` (convex): the fit holds at and
    between the probes, and beyond the widest while its steepest phase stays the steepest."""
    peaks = [measure_step(step, layer, make_input(w), w, exclude) for w in widths]
    out = {}
    for name in sorted({k for p in peaks for k in p}):
        per = [p.get(name, 0) / w for p, w in zip(peaks, widths)]  # bytes per token at each width
        key = max(0.0, *((b - a) / (w2 - w1) for a, b, w1, w2 in zip(per, per[1:], widths, widths[1:])))
        out[name] = Phase(max(0.0, *(m - key * w for m, w in zip(per, widths))), key)
    return WorkingSet(out)


FUSED = "outrider_fused_sdpa_shapes"


def _fused_sdpa_shapes(module, query, key, value, attention_mask, **kwargs):
    """What CUDA's fused SDPA kernels allocate, as shapes: query/key/value [B, n, T, d] -> the output
    [B, T, n, d_v]; the log-sum-exp [B, n, T] float32 and the mask in the query's dtype live meanwhile."""
    B, n, T, _ = query.shape
    lse = torch.empty(B, n, T, dtype=torch.float32, device=query.device)
    mask = attention_mask.to(query.dtype) if isinstance(attention_mask, torch.Tensor) else None
    out = torch.empty(B, n, T, value.shape[-1], dtype=query.dtype, device=query.device).transpose(1, 2)
    del lse, mask
    return out, None


@torch.no_grad()
def measure_decoder(config, decoder: torch.nn.Module, dtype: torch.dtype, layer_step: Callable,
                    attention: str = "math") -> WorkingSet:
    """The working set of a meta-device decoder's layers (see the module docstring); ``layer_step(layer,
    h, mask, pos, rotary, norm)`` is the step a pass runs."""
    import copy

    from transformers.masking_utils import create_causal_mask

    mask_config = copy.copy(config)  # the mask of the implementation the pass runs
    if attention == "fused" and config._attn_implementation == "sdpa":
        from transformers import AttentionInterface

        AttentionInterface.register(FUSED, _fused_sdpa_shapes)
        config._attn_implementation = FUSED
        try:
            return _measure_layers(config, mask_config, decoder, dtype, layer_step, create_causal_mask)
        finally:
            config._attn_implementation = "sdpa"
    return _measure_layers(config, mask_config, decoder, dtype, layer_step, create_causal_mask)


def _measure_layers(config, mask_config, decoder, dtype, layer_step, create_causal_mask) -> WorkingSet:
    from outrider.models import cache_parameter

    rotary = type(decoder.rotary_emb)(config=config).to("meta")
    norm = decoder.norm.to("meta")
    no_cache = {cache_parameter(create_causal_mask): None}

    def step(layer: torch.nn.Module, h: torch.Tensor, width: int) -> torch.Tensor:
        pad = torch.ones(1, width, dtype=torch.long)  # [1, width]
        pad[0, -1] = 0
        mask = create_causal_mask(config=mask_config, inputs_embeds=torch.empty(1, width, 1, dtype=dtype),
                                  attention_mask=pad, position_ids=torch.arange(width)[None], **no_cache)
        mask = mask.to(h.device) if isinstance(mask, torch.Tensor) else mask
        return layer_step(layer, h, mask, torch.arange(width, device=h.device)[None], rotary, norm)

    def make_input(width: int) -> torch.Tensor:
        return torch.empty(1, width, config.hidden_size, dtype=dtype, device="meta")  # [1, width, H]

    seen: dict[tuple, WorkingSet] = {}
    for layer in decoder.layers:
        shape = tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())
        if shape not in seen:
            seen[shape] = measure_working_set(step, layer, make_input, exclude=[*rotary.buffers(), *norm.parameters()])
    working = list(seen.values())
    for w in working[1:]:
        working[0] = working[0].largest(w)
    return working[0]
