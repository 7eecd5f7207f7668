"""Hidden states of a target bigger than the device, one decoder layer at a time (layer streaming).

Contract:
- ``StreamedTarget(target, aux_layer_ids, ...)`` builds the target on the meta device from its
  config (stock ``transformers`` classes; the text model of a wrapper such as Kimi-K2.5's
  ``kimi_k25``), checks every safetensors shard up front (``outrider.train.states.weights``), and keeps
  only the final norm resident. Used as a context manager (``close()`` frees its buffers).
- ``states(input_ids)`` -> one ``(aux, final)`` per example, on ``out_device``: ``aux``
  [len, n_aux*H] is Hugging Face ``output_hidden_states[j]`` for the aux ids ``j`` in the given
  order (the state entering decoder layer j), ``final`` [len, H] the last layer's output after
  the final norm. The tensors of one pass are views of one buffer.
- Passes: the examples, in the given order, are cut into passes of at most ``tokens_per_pass``
  tokens. A pass streams the whole model once: the embedding, then every decoder layer, each
  loaded (``outrider.train.states.layer_loader``: the next one is read and copied while this one
  computes), run over every token of the pass, and dropped. INT4 experts travel packed and are
  dequantized on the device.
- Chunks: inside a pass ``plan_chunks`` sorts the examples longest first (stable) and groups them
  into chunks that fit ``max_chunk_tokens`` and the memory plan. ``padded``:
  rows right-padded with the config's pad id (0 if unset) and a 2-D attention mask, positions
  ``arange(width)``; ``packed``: one row, positions restarting at every example, transformers'
  block-causal mask for packed sequences. Each chunk's states are bit-identical to the stock
  model's own forward on that chunk (padded: ``model(ids, attention_mask=mask)``; packed:
  ``model(ids, position_ids=pos, use_cache=False)``); grouping examples differently changes
  only float rounding (GEMM shapes).
- Memory: ``gpu_memory`` (GB) bounds the device bytes (``outrider.memory_plan.StreamMemory``): the
  largest layer built plus its checkpoint bytes and the next layer's, dequantization temporaries,
  the pass's states when they stay on the device, and one chunk's working set (attention, the MoE
  dispatch), measured before anything loads: each distinct layer shape runs on the meta device
  under a live-bytes count (``outrider.train.states.workset``; ``attention_memory``: SDPA priced
  at its math path, the default, or at CUDA's fused kernels). States that do not fit (or
  ``states_on="host"``) live in pinned host memory, each chunk copied in and out per layer. On CUDA
  the allocator is capped at the budget, and the host waits for a unit's kernels before it builds
  the next (else the freed checkpoint buffers of units still queued stay allocated: the plan holds
  two). A budget that cannot hold a layer and a one-token chunk (construction) or the longest
  example (``states``, before a pass loads anything) is a one-line ``UserError`` with the figures.
- ``stats``: one ``PassStats`` per pass (tokens, seconds, bytes read, copy / compute / exposed
  copy seconds).

Not done here: logits or the teacher (training projects ``final`` through the frozen ``lm_head``
rows), generation and KV caches, several devices, sliding-window or hybrid-attention models
(refused), writing a cache (the capture writer takes ``states``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from outrider.errors import UserError
from outrider.fsutil import read_json_object
from outrider.memory_plan import StreamMemory, size
from outrider.models import cache_parameter, check_aux_ids, parse_dtype, resolve
from outrider.train.data.datasets import consecutive_groups
from outrider.train.options import StreamOptions
from outrider.train.states.int4 import Int4Scheme
from outrider.train.states.layer_loader import LayerLoader, Loaded, Unit, UnitTiming
from outrider.train.states.workset import measure_decoder
from outrider.train.states.weights import (
    SafetensorsFiles,
    build_tensor,
    decoder_prefix,
    keep_fp32_pattern,
    module_recipes,
)

SUPPORTED = ("llama", "deepseek_v3")  # the families whose model forward the layer loop restates, tested
GB = 1e9


# --------------------------------------------------------------------------------------------
# The skeleton


def text_config(path: Path):
    """The text model's config of a checkpoint folder and its ``quantization_config`` (dict or None)."""
    from transformers import AutoConfig, DeepseekV3Config

    raw = read_json_object(path / "config.json")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    try:
        if text.get("model_type") == "kimi_k2":
            # Kimi-K2's text config (bare, or inside the kimi_k25 wrapper, which transformers versions
            # read differently): DeepSeek-V3's architecture, so read as DeepSeek-V3's config
            config = DeepseekV3Config(**{k: v for k, v in text.items() if k not in ("model_type", "quantization_config")})
            config.quantization_config = text.get("quantization_config") or raw.get("quantization_config")
        else:
            config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read the config of {path}: {str(e).splitlines()[0]}") from None
    outer = getattr(config, "quantization_config", None)
    config = config.get_text_config()
    quant = getattr(config, "quantization_config", None) or outer
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the skeleton is dense: INT4 is dequantized as each layer arrives
    if config.model_type not in SUPPORTED:
        raise UserError(f"layer streaming supports {', '.join(SUPPORTED)} targets, not '{config.model_type}': "
                        "load it whole (or with --device-map) instead")
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        raise UserError("layer streaming supports full-attention layers only: this target has sliding or hybrid "
                        "layers; load it whole (or with --device-map) instead")
    return config, (quant.to_dict() if hasattr(quant, "to_dict") else quant)


def build_skeleton(config, dtype: torch.dtype, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The causal LM on the meta device (no memory), frozen, in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval().requires_grad_(False)


# --------------------------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class Chunk:
    examples: tuple[int, ...]  # indices into the pass's examples, rows (or packed segments) in this order
    lengths: tuple[int, ...]
    packed: bool

    @property
    def rows(self) -> int:
        return 1 if self.packed else len(self.examples)

    @property
    def width(self) -> int:
        return sum(self.lengths) if self.packed else max(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.width


def plan_passes(lengths: Sequence[int], tokens_per_pass: int) -> list[list[int]]:
    """Consecutive examples grouped into passes of at most ``tokens_per_pass`` tokens (a longer
    example is a pass of its own)."""
    return consecutive_groups(lengths, tokens_per_pass)


def plan_chunks(lengths: Sequence[int], packed: bool, max_tokens: int,
                fits: Callable[[Chunk], bool] | None = None) -> list[Chunk]:
    """Examples (by index into ``lengths``) sorted longest first (stable) and grouped greedily into
    chunks of at most ``max_tokens`` padded tokens that ``fits`` accepts; a chunk holds at least one example."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []

    def ok(members: list[int]) -> bool:
        c = Chunk(tuple(members), tuple(lengths[i] for i in members), packed)
        return c.padded_tokens <= max_tokens and (fits is None or fits(c))

    for i in order:
        if chunks and ok(chunks[-1] + [i]):
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return [Chunk(tuple(c), tuple(lengths[i] for i in c), packed) for c in chunks]


def layer_step(layer: torch.nn.Module, h: torch.Tensor, mask: Any, pos: torch.Tensor, rotary: torch.nn.Module,
               norm: torch.nn.Module | None) -> torch.Tensor:
    """One decoder layer over a chunk, h [rows, width, H] -> [rows, width, H] (then the final norm when
    given): what a pass runs and what the working set is measured on."""
    h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rotary(h, pos))
    return norm(h) if norm is not None else h


@dataclass
class PassStats:
    examples: int
    tokens: int
    padded_tokens: int
    chunks: int
    states_on: str  # "device" | "host"
    planned_bytes: float = 0.0  # the memory plan's device peak for this pass
    wall_s: float = 0.0
    nbytes: int = 0  # checkpoint bytes moved
    read_s: float = 0.0  # host reads into the staging buffers
    copy_s: float = 0.0  # host-to-device copies (CUDA)
    compute_s: float = 0.0  # unit computations, dequantization included
    build_s: float = 0.0  # of which building the weights (dequantization, expert fusion, casts)
    exposed_s: float = 0.0  # compute idle waiting for weights
    units: list[UnitTiming] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def hidden_share(self) -> float:
        """The share of the loading time (read + copy) hidden behind compute."""
        load = self.read_s + self.copy_s
        return max(0.0, 1.0 - self.exposed_s / load) if load else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "units"} | {
            "tokens_per_s": self.tokens_per_s, "hidden_share": self.hidden_share}


# --------------------------------------------------------------------------------------------
# One pass's states


class _PinnedPool:
    """Page-locked host buffers kept from pass to pass (pinning gigabytes costs seconds)."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self.buffers.get(role)
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[role] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes].view(dtype)


class _Pass:
    """Inputs of every chunk (on the device) and the pass's states (on the device or pinned host)."""

    def __init__(self, examples: list[list[int]], chunks: list[Chunk], device: torch.device, home: torch.device,
                 hidden: int, n_aux: int, dtype: torch.dtype, pad_id: int, pinned: "_PinnedPool | None" = None):
        self.chunks, self.device, self.home = chunks, device, home
        pin = home.type == "cpu" and device.type == "cuda"  # states in page-locked host memory
        self.ids, self.masks, self.positions, self.real, self.rows = [], [], [], [], []
        self.owner: list[tuple[int, int, int]] = []  # (example, output row, length), in output order
        at = 0
        for c in chunks:
            ids = torch.full((c.rows, c.width), pad_id, dtype=torch.long)  # [rows, width]
            if c.packed:
                ids[0] = torch.tensor([t for i in c.examples for t in examples[i]])
                pos = torch.cat([torch.arange(n) for n in c.lengths])[None]  # [1, tokens], restarting per example
                mask, real = None, None
            else:
                mask = torch.zeros(c.rows, c.width, dtype=torch.long)  # [rows, width]
                for r, i in enumerate(c.examples):
                    ids[r, : c.lengths[r]] = torch.tensor(examples[i])
                    mask[r, : c.lengths[r]] = 1
                pos = torch.arange(c.width)[None]  # [1, width], the model's default
                padded = c.padded_tokens != c.tokens
                real = torch.cat([r * c.width + torch.arange(n) for r, n in enumerate(c.lengths)]) if padded else None
                mask = mask if padded else None  # all ones: the model would drop it too
            self.ids.append(ids.to(device))
            self.masks.append(None if mask is None else mask.to(device))
            self.positions.append(pos.to(device))
            self.real.append(None if real is None else real.to(device))
            self.rows.append((at, at + c.tokens))
            for i, n in zip(c.examples, c.lengths):
                self.owner.append((i, at, n))
                at += n
        padded = sum(c.padded_tokens for c in chunks)
        def empty(role: str, *shape: int) -> torch.Tensor:
            if pin and pinned is not None:
                return pinned.take(role, math.prod(shape), dtype).view(*shape)
            return torch.empty(*shape, dtype=dtype, device=home)

        flat = empty("h", padded * hidden)
        self.h, start = [], 0
        for c in chunks:  # [rows, width, hidden] each, one buffer
            self.h.append(flat[start: start + c.padded_tokens * hidden].view(c.rows, c.width, hidden))
            start += c.padded_tokens * hidden
        self.aux = empty("aux", n_aux, at, hidden)  # [n_aux, tokens, H]
        self.final = empty("final", at, hidden)  # [tokens, H]

    def load(self, c: int) -> torch.Tensor:
        return self.h[c].to(self.device, non_blocking=True)  # [rows, width, H]

    def store(self, c: int, h: torch.Tensor) -> None:
        if h.data_ptr() != self.h[c].data_ptr():
            self.h[c].copy_(h, non_blocking=True)

    def real_rows(self, c: int, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])  # [rows*width, H]
        return flat if self.real[c] is None else flat.index_select(0, self.real[c])  # [tokens, H]

    def put_aux(self, c: int, k: int, h: torch.Tensor) -> None:
        a, b = self.rows[c]
        self.aux[k, a:b].copy_(self.real_rows(c, h), non_blocking=True)

    def put_final(self, c: int, h: torch.Tensor) -> None:
        a, b = self.rows[c]
        self.final[a:b].copy_(self.real_rows(c, h), non_blocking=True)


# --------------------------------------------------------------------------------------------
# The streamed target


class StreamedTarget:
    """A target streamed layer by layer; ``states(input_ids)`` gives aux and final hidden states."""

    def __init__(self, target: str | Path, aux_layer_ids: Sequence[int] | None = None,
                 device: torch.device | str | None = None, dtype: str | torch.dtype | None = None,
                 gpu_memory: float | None = None, tokens_per_pass: int | None = None,
                 max_chunk_tokens: int | None = None, packing: str = "padded", out_device: torch.device | str = "cpu",
                 attn_implementation: str = "sdpa", read_threads: int = 8, temp_bytes: int = 1 << 30,
                 states_on: str = "auto", attention_memory: str = "math"):
        path = resolve(target)
        if path.is_file():
            raise UserError(f"{path} is a GGUF file: layer streaming reads a safetensors model folder")
        if packing not in ("padded", "packed"):
            raise UserError(f"packing must be 'padded' or 'packed', not '{packing}'")
        if states_on not in ("auto", "device", "host"):
            raise UserError(f"states_on must be 'auto', 'device' or 'host', not '{states_on}'")
        if attention_memory not in ("math", "fused"):
            raise UserError(f"attention_memory must be 'math' or 'fused', not '{attention_memory}'")
        self.states_on = states_on
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = parse_dtype(dtype, self.device)
        self.config, quant = text_config(path)
        self.int4 = Int4Scheme.from_config(quant)
        self.files = SafetensorsFiles(path)
        self.model = build_skeleton(self.config, self.dtype, attn_implementation)
        self.num_layers = self.config.num_hidden_layers
        ids = aux_layer_ids if aux_layer_ids is not None else (2, self.num_layers // 2, self.num_layers - 3)
        self.aux_layer_ids = check_aux_ids(ids, self.num_layers)
        self.hidden_size = self.config.hidden_size
        self.packed = packing == "packed"
        self.out_device = torch.device(out_device)
        self.temp_bytes = int(temp_bytes)
        self.pad_id = int(self.config.pad_token_id) if self.config.pad_token_id is not None else 0
        cuda = self.device.type == "cuda"
        self.tokens_per_pass = int(tokens_per_pass or (262144 if cuda else 16384))
        self.max_chunk_tokens = int(max_chunk_tokens or (32768 if cuda else 4096))
        if self.tokens_per_pass < 1 or self.max_chunk_tokens < 1:
            raise UserError("--tokens-per-pass and the chunk size must be at least 1")
        self.units = self._units()
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.working = measure_decoder(self.config, self.decoder, self.dtype, layer_step, attention_memory)
        self.memory = self._memory(gpu_memory)
        self.budget = self.memory.budget
        self.stats: list[PassStats] = []
        self._pinned = _PinnedPool()
        self._fraction_set = False
        self._done: torch.cuda.Event | None = None  # the previous unit's kernels, all queued
        if cuda and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            # freed chunks of many sizes: without growable segments the cache fragments past the plan's reserve
            # (RESULTS.md, layer-streamed capture: the out-of-memory of 2026-12-06)
            setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.10; older: cuda's
            (setting or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
        if cuda and gpu_memory is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget / total), self.device)
            self._fraction_set = True
        self.norm = self._resident(self.decoder.norm, "norm")
        self.rotary = type(self.decoder.rotary_emb)(config=self.config).to(self.device)  # inv_freq is not saved
        self.loader = LayerLoader(self.files, self.device, max(u.raw_bytes for u in self.units),
                                  read_threads if cuda else 1)

    # -- setup ----------------------------------------------------------------------------------

    @property
    def decoder(self) -> torch.nn.Module:
        return self.model.get_decoder()

    def _units(self) -> list[Unit]:
        prefix = decoder_prefix(self.files)
        keep = keep_fp32_pattern(self.model, self.dtype)
        dec, congruent = self.decoder, self.device.type == "cpu"  # CPU: aligned as transformers' memory map
        units = [Unit.of(self.files, "embed_tokens", dec.embed_tokens,
                         module_recipes(self.files, dec.embed_tokens, "model.embed_tokens", prefix + "embed_tokens.",
                                        keep), congruent)]
        for i, layer in enumerate(dec.layers):
            units.append(Unit.of(self.files, f"layers.{i}", layer,
                                 module_recipes(self.files, layer, f"model.layers.{i}", f"{prefix}layers.{i}.", keep),
                                 congruent))
        self.prefix, self.keep = prefix, keep
        return units

    def _resident(self, module: torch.nn.Module, name: str) -> torch.nn.Module:
        recipes = module_recipes(self.files, module, f"model.{name}", f"{self.prefix}{name}.", self.keep)
        sd = {r.key: build_tensor(r, self.files.tensor).to(self.device).clone() for r in recipes}
        module.load_state_dict(sd, strict=True, assign=True)
        return module

    def weights_need(self) -> int:
        """Device bytes for weights at the peak: the largest unit built plus its checkpoint bytes,
        the next unit's checkpoint bytes and the dequantization temporaries."""
        return int(self._resident_bytes() + self._temporaries())

    def _resident_bytes(self) -> int:
        return max(u.raw_bytes + u.built_bytes for u in self.units) + max(u.raw_bytes for u in self.units)

    def _temporaries(self) -> int:
        return 2 * min(self.temp_bytes, max(u.built_bytes for u in self.units))

    def _memory(self, gpu_memory: float | None) -> StreamMemory:
        unbounded = gpu_memory is None and self.device.type != "cuda"
        free = gpu_memory is None and not unbounded
        budget = math.inf if unbounded else (
            torch.cuda.mem_get_info(self.device)[0] - (1 << 30) if free else float(gpu_memory) * GB)
        H, b = self.hidden_size, self.itemsize
        memory = StreamMemory(budget, self._resident_bytes(), self._temporaries(),
                              state_per_token=H * b * (len(self.aux_layer_ids) + 2), input_per_token=H * b,
                              pass_per_token=3 * 8, working=self.working)
        if not memory.chunk_fits(1, 1):  # a one-token chunk
            what = f"the free device memory ({budget / GB:.2f} GB)" if free else f"--gpu-memory {gpu_memory:g} GB"
            raise UserError(memory.refusal(what, 1, 1))
        return memory

    @property
    def pass_tokens(self) -> int:
        """Tokens a caller should hand over per call (``outrider.train.states.cache_capture``'s protocol)."""
        return self.tokens_per_pass

    # -- capture --------------------------------------------------------------------------------

    def plan(self, lengths: Sequence[int]) -> tuple[list[Chunk], str]:
        """The chunks of one pass of examples of these lengths, and where its states live ("device" or
        "host"); a ``UserError`` when not even the longest example fits beside a layer."""
        m, tokens = self.memory, sum(lengths)
        if self.states_on != "host" or self.device.type == "cpu":  # the CPU has no other memory to move to
            padded = tokens
            for _ in range(2):  # the padding of the chunks is the pass's too: chunk again with it
                chunks = plan_chunks(lengths, self.packed, self.max_chunk_tokens,
                                     lambda c: m.chunk_fits(c.padded_tokens, c.width, padded, True))
                padded = sum(c.padded_tokens for c in chunks)
            if self.device.type == "cpu" or self.states_on == "device" or self._peak(chunks, "device") <= m.usable:
                self._check(chunks, "device", tokens)
                return chunks, "device"
        chunks = plan_chunks(lengths, self.packed, self.max_chunk_tokens,
                             lambda c: m.chunk_fits(c.padded_tokens, c.width, tokens))
        self._check(chunks, "host", tokens)
        return chunks, "host"

    def _peak(self, chunks: list[Chunk], where: str) -> float:
        """The plan's device peak for a pass in these chunks (padded states on the device, or none)."""
        padded = sum(c.padded_tokens for c in chunks)
        return max(self.memory.peak(padded, c.padded_tokens, c.width, where == "device") for c in chunks)

    def _check(self, chunks: list[Chunk], where: str, tokens: int) -> None:
        if self._peak(chunks, where) <= self.memory.usable:
            return
        what = f"--gpu-memory {self.budget / GB:g} GB" if math.isfinite(self.budget) else "the device"
        big = max(chunks, key=lambda c: self.memory.chunk_bytes(c.padded_tokens, c.width, where == "device"))
        if where == "device" and self.memory.chunk_fits(big.padded_tokens, big.width):
            raise UserError(f"{what} cannot hold the states of a pass of {tokens:,} tokens "
                            f"({size(self._peak(chunks, where))} with a layer and a chunk): lower --tokens-per-pass")
        raise UserError(self.memory.refusal(what, big.padded_tokens, big.width))

    @torch.no_grad()
    def states(self, input_ids: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per example: aux [len, n_aux*H] and final [len, H] (see the module docstring)."""
        examples = [[int(t) for t in x] for x in input_ids]
        vocab = self.config.vocab_size
        for i, x in enumerate(examples):
            if not x:
                raise UserError(f"example {i} has no tokens")
            if min(x) < 0 or max(x) >= vocab:
                raise UserError(f"example {i} has token ids outside the target's vocabulary of {vocab}: data of "
                                "another tokenizer?")
        lengths = [len(x) for x in examples]
        passes = plan_passes(lengths, self.tokens_per_pass)
        plans = [self.plan([lengths[i] for i in members]) for members in passes]  # refused before loading
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(examples)
        stream = self.loader.stream([u for _ in passes for u in self.units], then=self.units[0])
        try:
            for members, plan in zip(passes, plans):
                for i, result in zip(members, self._pass([examples[i] for i in members], plan, stream)):
                    out[i] = result
        finally:
            stream.close()
        return out  # type: ignore[return-value]

    def _pass(self, examples: list[list[int]], plan: tuple[list[Chunk], str],
              stream) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t0 = time.perf_counter()
        chunks, where = plan
        home = self.device if where == "device" else torch.device("cpu")
        run = _Pass(examples, chunks, self.device, home, self.hidden_size, len(self.aux_layer_ids), self.dtype,
                    self.pad_id, self._pinned)
        stats = PassStats(len(examples), sum(c.tokens for c in chunks), sum(c.padded_tokens for c in chunks),
                          len(chunks), where, self._peak(chunks, where))
        for index in range(len(self.units)):
            loaded = next(stream)
            self._unit(run, loaded, index - 1)  # the embedding is unit 0, decoder layer i unit i+1
            stats.units.append(loaded.timing)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # states copied to pinned memory have landed
        reused = run.final.is_pinned()  # pooled host buffers: the next pass overwrites them
        aux = run.aux.to(self.out_device)  # [n_aux, tokens, H]
        aux = aux.permute(1, 0, 2).reshape(aux.shape[1], -1)  # [tokens, n_aux*H]
        if reused and aux.data_ptr() == run.aux.data_ptr():
            aux = aux.clone()
        final = run.final.to(self.out_device, copy=reused and run.final.device == self.out_device)
        self._finish_stats(stats, time.perf_counter() - t0)
        result: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(examples)  # type: ignore[list-item]
        for i, at, n in run.owner:
            result[i] = (aux[at: at + n], final[at: at + n])
        return result

    def _unit(self, run: _Pass, loaded: Loaded, layer: int) -> None:
        """Embedding (layer -1) or decoder layer ``layer`` over every chunk of the pass."""
        from transformers.masking_utils import create_causal_mask

        no_cache = {cache_parameter(create_causal_mask): None}
        timing, cuda = loaded.timing, self.device.type == "cuda"
        t0 = time.perf_counter()
        if cuda:
            if self._done is not None:  # the host may not run ahead: a unit's checkpoint buffer (record_stream)
                self._done.synchronize()  # is freed only once the kernels queued on it have run
            timing.events["compute0"] = _event()
        loaded.materialise(self.temp_bytes)
        if cuda:
            timing.events["built"] = _event()
        else:
            timing.build_s = time.perf_counter() - t0
        module = loaded.unit.module
        for c in range(len(run.chunks)):
            if layer < 0:
                run.store(c, module(run.ids[c]))  # [rows, width, H]
                continue
            h = run.load(c)  # [rows, width, H]
            for k, j in enumerate(self.aux_layer_ids):
                if j == layer:
                    run.put_aux(c, k, h)
            pos = run.positions[c]  # [1, width]
            mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=run.masks[c],
                                      position_ids=pos, **no_cache)
            last = layer == self.num_layers - 1
            h = layer_step(module, h, mask, pos, self.rotary, self.norm if last else None)  # [rows, width, H]
            if last:
                run.put_final(c, h)
            else:
                run.store(c, h)
        if cuda:
            timing.events["compute1"] = self._done = _event()
        else:
            timing.compute_s = time.perf_counter() - t0
        loaded.release()

    def _finish_stats(self, stats: PassStats, wall: float) -> None:
        stats.wall_s = wall
        stats.nbytes = sum(t.nbytes for t in stats.units)
        stats.read_s = sum(t.read_s for t in stats.units)
        if self.device.type == "cuda":
            stats.copy_s = sum(t.ms("copy0", "copy1") for t in stats.units) / 1e3
            stats.compute_s = sum(t.ms("compute0", "compute1") for t in stats.units) / 1e3
            stats.build_s = sum(t.ms("compute0", "built") for t in stats.units) / 1e3
            stats.exposed_s = sum(a.events["compute1"].elapsed_time(b.events["compute0"])
                                  for a, b in zip(stats.units, stats.units[1:])) / 1e3
        else:
            stats.compute_s = sum(t.compute_s for t in stats.units)
            stats.build_s = sum(t.build_s for t in stats.units)
            stats.exposed_s = sum(t.wait_s for t in stats.units)
        self.stats.append(stats)

    def close(self) -> None:
        self._pinned.buffers.clear()
        self.loader.close()
        self.files.close()
        if self._fraction_set:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self._fraction_set = False

    def __enter__(self) -> "StreamedTarget":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def streamed_source(target: str, aux_layer_ids: Sequence[int] | None, stream: StreamOptions | None,
                    device: Any = None) -> "StreamedTarget | None":
    """``outrider capture --stream-layers``: the capture's hidden-state source, or None (load the target)."""
    if stream is None:
        return None
    ids = sorted(aux_layer_ids) if aux_layer_ids is not None else None
    return StreamedTarget(target, ids, device=device, **stream.as_kwargs())


def _event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e
