"""A preallocated KV cache addressed by slot, so that rejecting draft tokens costs nothing.

Contract:
- ``SlotCache`` is a ``transformers`` ``Cache``: a stock model writes its keys and values (or, for
  MLA, its compressed latents) through ``update`` into preallocated slots chosen by us. Every
  row of the batch owns the same slots; a per-row ``valid`` mask says which slots hold
  committed tokens of that row. A rejected token is never cropped or copied: its slot is simply
  left invalid (masked) or reused by the next forward.
- Rotary positions do not depend on slots: each row keeps its own ``lengths`` (the position id
  of its next token), so rows of a batch may accept different numbers of tokens.
- ``CachedLM`` runs one forward over ``n`` new tokens per row: it picks the slots, builds the
  additive 4-D attention mask (committed slots of the row + causal or tree structure among the
  new tokens), passes explicit position ids, and returns logits (and aux hidden states when
  asked). ``commit(keep)`` then marks which of those ``n`` tokens each row keeps.
- ``read_len="used"`` hands attention only the slots written so far (cheap on the CPU);
  ``read_len="max"`` always hands the whole buffer, giving fixed shapes for CUDA graphs and
  sparing attention backends a new plan for every length. ``"auto"`` (default) picks ``max``
  on CUDA and ``used`` elsewhere. With ``max`` the first free slot also lives on the device
  (``ptr_dev``) and the mask is built from it, so a CUDA graph can build it inside the replay.
- ``CachedLM(graphs=True)`` replays, per width ``n``, one CUDA graph that builds positions and
  mask and runs the model; with ``compile=True`` that body is first compiled by
  ``torch.compile`` (kernel fusion; one compiled function per process, shared by every cache),
  then captured. Outside a step the host only reserves the slots (two tiny kernels) and copies
  the token ids. ``greedy_run`` chains plain greedy steps on the device (a graph that also takes
  the argmax, feeds it back and commits it), with no host synchronisation between steps.
  Captured steps record batched experts for mixture-of-experts layers and ``slot_attention`` for
  the attention (``graph_kernels``); eager steps (prefill, the CPU) keep the model's own. A
  prompt's forward at the cache's start also replays as a graph, one per (batch, width, logits
  asked), eager kernels and the model's own attention, for dense full-attention targets
  (``graphable``; callers pad prompts to a few widths: ``prefill_graphs_apply``).

Not done here: paging, sharing prefixes between rows, eviction. The cache holds at most
``max_len`` slots; asking for more is a clear error, never a silent overwrite.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch

from outrider.ops.graphs import (
    CompileOptions,
    capture_graph,
    compile_options,
    compiled,
    graph_kernels,
    graphable,
)
from outrider.decode.kv_cache import SlotCache
from outrider.models import AuxCapture, cache_parameter


def prefill_graphs_apply(model: torch.nn.Module, batch: int, width: int) -> bool:
    """Would a graphed ``CachedLM`` replay a prompt forward of ``batch`` x ``width`` as a graph?
    (``graphable`` model, at most ``PREFILL_GRAPH_TOKENS`` positions; ``PREFILL_GRAPHS_MAX`` aside.)"""
    return batch * width <= PREFILL_GRAPH_TOKENS and graphable(model)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which this transformers version's ``forward`` takes the cache."""
    return cache_parameter(model.forward)


def _prefill_step(lm: "CachedLM", ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                  logits_at: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A forward over given positions and mask (prompts, ragged blocks): (logits, aux)."""
    extra = {lm._cache_kw: lm.cache}
    if logits_at is not None:
        extra["logits_to_keep"] = logits_at
    out = lm.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
    aux = lm.capture.concat() if lm.capture is not None else None
    return out.logits, aux  # [batch, n or m, vocab], [batch, n, len(ids) * hidden] or None


def _plain_step(lm: "CachedLM", ids: torch.Tensor, offsets: torch.Tensor | None = None,
                new_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Positions, mask and forward of a step over reserved slots: (logits, aux). A chain's new
    tokens sit at the rows' next positions, causally; a tree's (``offsets`` [rows, n] past the
    row's length, ``new_mask`` [rows, n, n]) at the root's position plus their depth, under
    their ancestry."""
    B, n = ids.shape  # ids: [batch, n]
    positions = lm.cache.lengths[:, None] + (lm.cache.arange[:n] if offsets is None else offsets)  # [batch, n]
    query_valid = torch.ones(B, n, dtype=torch.bool, device=ids.device)
    mask = lm.cache.attention_mask(query_valid, causal_mask(n, ids.device) if new_mask is None else new_mask, lm.dtype)
    return _prefill_step(lm, ids, positions, mask, None)  # [batch, n, vocab], aux


@functools.cache
def _compiled_prefill(options: CompileOptions):
    """``_prefill_step`` compiled once per process and options, dynamic in every size from the start
    (prompt lengths vary from call to call): an eager prefill launches each of the model's few
    hundred small kernels from Python. With frozen weights each compiled variant holds its own
    folded projections (with and without aux capture, say): a target whose weights barely fit
    sets ``compile_prefill=False``."""
    return compiled(_prefill_step, options, dynamic=True)


@functools.cache
def _compiled_step(options: CompileOptions):
    """``_plain_step`` compiled once per process and options, shared by every ``CachedLM``.

    One compiled function (rather than one per cache) lets a new cache of the same model reuse
    the compiled code: with static shapes one variant per width 1..k+1, batch size and cache
    size; otherwise those become dynamic after their first change.
    """
    return compiled(_plain_step, options)


PROMPT_BUCKET = 64  # with graphs, prompts are padded to a multiple of this width (a graph per width)
PREFILL_GRAPH_TOKENS = 4096  # with graphs, prompts of up to this many batch x width positions replay as a graph,
PREFILL_GRAPHS_MAX = 16  # ... for this many (batch, width, logits asked) per cache at most (each keeps its outputs)


def cached_lm_read_len(read_len: str, device: torch.device | str, graphs: bool, compile: bool | str) -> str:
    """The ``read_len`` a ``CachedLM`` gives its cache: ``"max"`` for graphs (CUDA) or a compiled step."""
    return "max" if (graphs and torch.device(device).type == "cuda") or compile else read_len


def causal_mask(n: int, device: torch.device | str) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n]


class CachedLM:
    """A stock causal LM bound to a ``SlotCache`` for one batch of requests.

    ``forward(ids, positions, query_valid, new_mask)`` runs the model over ``n`` new tokens per
    row and returns logits ``[batch, n, vocab]``; when ``aux_layer_ids`` were given, ``self.aux``
    holds the captured hidden states ``[batch, n, len(ids) * hidden]`` of the same forward.
    With ``compile`` the plain step is compiled (and captured per width with ``graphs``); so is
    the forward over given positions and masks (prompts) when ``compile_prefill`` (off by default:
    its compilation, dynamic in every size, took 130 s on a 2-core CPU for the default model and
    is the likely reason two H200 benchmark calls ran past 170 and 440 s), once, dynamic in its sizes.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, max_len: int,
                 aux_layer_ids: Sequence[int] | None = None, read_len: str = "auto", graphs: bool = False,
                 compile: bool | str | CompileOptions | None = False, attention: str = "slots",
                 compile_prefill: bool = False):
        if attention not in ("slots", "model"):
            raise ValueError(f"attention must be 'slots' or 'model', got {attention!r}")
        self.model = model
        self.slot_attention = attention == "slots"  # captured steps only (``graph_kernels``)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.graphs = graphs and self.device.type == "cuda"
        read_len = cached_lm_read_len(read_len, self.device, graphs, compile)
        self.cache = SlotCache(model.config.num_hidden_layers, batch_size, max_len, self.device, read_len)
        # hooks on only while this cache's steps run: another cache of the same model adds none
        self.capture = AuxCapture(model, aux_layer_ids, attach=False) if aux_layer_ids else None
        self.aux: torch.Tensor | None = None
        self._cache_kw = cache_kwarg(model)
        self._graphs: dict[tuple[int, int], tuple] = {}  # (n, tree rows or 0) -> (graph, inputs, logits, aux)
        self._prefill_graphs: dict[tuple[int, int, int], tuple] = {}  # (batch, n, m) -> graph, inputs, outputs
        self._mempool = None
        self._greedy: tuple | None = None  # graph mode: the self-feeding greedy step (greedy_run)
        self.compile_options = compile_options(compile)  # of the plain step; None: eager
        self._step_fn = _plain_step if self.compile_options is None else _compiled_step(self.compile_options)
        # the other forwards (prompts, ragged blocks) compiled too, on request (slow to compile)
        fused_prefill = self.compile_options is not None and compile_prefill
        self._prefill_fn = _compiled_prefill(self.compile_options) if fused_prefill else _prefill_step

    def step_body(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                  new_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step over reserved slots (a tree's with ``offsets`` and ``new_mask``: ``_plain_step``),
        eager or compiled: (logits, aux)."""
        with self._hooks():
            return self._step_fn(self, ids) if offsets is None else self._step_fn(self, ids, offsets, new_mask)

    def _hooks(self):
        return self.capture.attached() if self.capture is not None else contextlib.nullcontext()

    def reset(self) -> None:
        self.cache.reset()
        self.aux = None

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths  # [batch]

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
               new_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decode / verify step over ``n`` new tokens per row: logits ``[batch, n, vocab]``.

        ids: [batch, n]. A chain (no ``offsets``): positions follow the rows' lengths, causal new
        tokens. A tree: offsets [rows, n] (the root's 0, then the nodes' depths) and new_mask
        [rows, n, n] (``Draft.offsets``, ``Draft.verify_mask``; rows 1 or batch). With graphs, one
        CUDA graph per (width, tree rows) replays it, offsets and mask copied into its inputs.
        """
        self.cache.begin(ids.shape[1])
        if self.graphs:
            return self._replay(ids, offsets, new_mask)
        logits, self.aux = self.step_body(ids, offsets, new_mask)
        return logits

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
                query_valid: torch.Tensor | None = None, new_mask: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        # ids: [batch, n]; positions: [batch, n] (default: lengths + 0..n-1)
        # logits_at: [m] sequence indices whose logits are wanted (default: all n); prefill asks
        # for the last prompt positions only, sparing a [batch, P, vocab] projection
        if positions is None and query_valid is None and new_mask is None and logits_at is None:
            return self.verify(ids)
        self.cache.begin(ids.shape[1])
        if self._prefill_graphed(ids, positions, query_valid, new_mask, logits_at):
            return self._replay_prefill(ids, query_valid, logits_at)
        logits, self.aux = self._prefill(ids, positions, query_valid, new_mask, logits_at)
        return logits  # [batch, n or m, vocab]

    def _prefill(self, ids: torch.Tensor, positions: torch.Tensor | None, query_valid: torch.Tensor | None,
                 new_mask: torch.Tensor | None, logits_at: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """The forward over given positions and masks (defaults: the rows' next positions, all
        queries valid, causal new tokens) in the reserved slots: (logits, aux)."""
        B, n = ids.shape
        if positions is None:
            positions = self.cache.lengths[:, None] + torch.arange(n, device=ids.device)
        if query_valid is None:
            query_valid = torch.ones(B, n, dtype=torch.bool, device=ids.device)
        if new_mask is None:
            new_mask = causal_mask(n, ids.device)
        mask = self.cache.attention_mask(query_valid, new_mask, self.dtype)
        # one index asked twice: a compiled prefill specialises a size of 1, and recompiling between
        # calls that ask one row and calls that ask several would land in timed runs
        one = logits_at is not None and logits_at.shape == (1,)
        with self._hooks():
            logits, aux = self._prefill_fn(self, ids, positions.clamp_min(0), mask,
                                           logits_at.repeat(2) if one else logits_at)
        return (logits[:, :1] if one else logits), aux  # [batch, n or m, vocab], aux

    def _prefill_graphed(self, ids: torch.Tensor, positions, query_valid, new_mask, logits_at) -> bool:
        """Replay this forward as a CUDA graph? A prompt's: at the cache's start, default positions
        and causal mask, some logits asked, eager kernels (not with ``compile_prefill``), where
        ``prefill_graphs_apply``, and a graph of its shape exists or fewer than ``PREFILL_GRAPHS_MAX`` do."""
        if not (self.graphs and self.cache.ptr == 0 and positions is None and new_mask is None
                and logits_at is not None and self._prefill_fn is _prefill_step
                and prefill_graphs_apply(self.model, *ids.shape)):
            return False
        return (*ids.shape, logits_at.shape[0]) in self._prefill_graphs or len(self._prefill_graphs) < PREFILL_GRAPHS_MAX

    def _replay_prefill(self, ids: torch.Tensor, query_valid: torch.Tensor | None,
                        logits_at: torch.Tensor) -> torch.Tensor:
        """A prompt's forward as a CUDA graph captured once per (batch, width, logits asked), with
        the model's own attention (many queries); the caller pads prompts to a few widths."""
        if query_valid is None:
            query_valid = torch.ones_like(ids, dtype=torch.bool)
        key = (*ids.shape, logits_at.shape[0])
        entry = self._prefill_graphs.get(key)
        if entry is None:
            s_ids, s_valid, s_at = ids.clone(), query_valid.clone(), logits_at.clone()
            # warm-ups write only into the reserved slots, which the forward does not commit
            graph, outputs = self._capture_fn(lambda: self._prefill(s_ids, None, s_valid, None, s_at), slots=False)
            entry = self._prefill_graphs[key] = (graph, s_ids, s_valid, s_at, outputs)
        graph, s_ids, s_valid, s_at, (logits, aux) = entry
        s_ids.copy_(ids)
        s_valid.copy_(query_valid)
        s_at.copy_(logits_at)
        graph.replay()
        self.aux = aux
        return logits

    def _replay(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                new_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the step as a CUDA graph captured once per width n (and, for trees, rows of the
        offsets and mask): static shapes and slots, the inputs copied in."""
        key = (ids.shape[1], 0 if offsets is None else offsets.shape[0])
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(ids, offsets, new_mask)
            self._graphs[key] = entry
        graph, s_ids, s_offsets, s_mask, s_logits, s_aux = entry
        s_ids.copy_(ids)
        if offsets is not None:
            s_offsets.copy_(offsets)
            s_mask.copy_(new_mask)
        graph.replay()
        self.aux = s_aux
        return s_logits

    def _capture_fn(self, fn: Callable[[], Any], after_each: Callable[[], Any] | None = None,
                    slots: bool | None = None) -> tuple:
        """Capture a step of this model as a CUDA graph in the cache's pool: (graph, outputs);
        ``slots``: attend by ``slot_attention`` (default: as this cache's steps do)."""
        if self._mempool is None:  # the graphs of one cache share a pool: they replay one at a time
            self._mempool = torch.cuda.graph_pool_handle()
        with graph_kernels(self.model, self.slot_attention if slots is None else slots):
            return capture_graph(fn, self.device, warmups=3, pool=self._mempool, after_each=after_each)

    def _capture(self, ids: torch.Tensor, offsets: torch.Tensor | None, new_mask: torch.Tensor | None) -> tuple:
        s_ids = ids.clone()
        s_offsets = None if offsets is None else offsets.clone()
        s_mask = None if new_mask is None else new_mask.clone()
        # warm-up (and compilation) writes only into reserved, not yet valid slots
        graph, (logits, aux) = self._capture_fn(lambda: self.step_body(s_ids, s_offsets, s_mask))
        return graph, s_ids, s_offsets, s_mask, logits, aux

    @torch.no_grad()
    def greedy_run(self, last: torch.Tensor, steps: int) -> torch.Tensor:
        """``steps`` plain greedy steps, each fed the previous argmax, with no host synchronisation.

        last: [batch] the token each row feeds first. Returns the argmax of every step [batch, steps]
        (on the device). Every row keeps every token: a caller that stops a row (EOS, length)
        ignores its later tokens, which changes nothing for the other rows. With graphs the whole
        step (slots, positions, mask, forward, argmax, commit) is one CUDA graph replayed
        ``steps`` times; otherwise the same operations run eagerly.
        """
        if self.cache.ptr + steps > self.cache.max_len:
            raise RuntimeError(f"KV cache full: {self.cache.ptr} + {steps} slots > max_len {self.cache.max_len}")
        if not self.graphs:
            ids, toks = last[:, None], []
            keep = torch.ones(last.shape[0], 1, dtype=torch.bool, device=last.device)
            for _ in range(steps):
                ids = self.forward(ids)[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
                self.commit(keep, used=1)
                toks.append(ids)
            return torch.cat(toks, dim=1)  # [batch, steps]
        self.cache.begin(1)
        if self._greedy is None:
            self._greedy = self._capture_greedy(last)
        graph, s_tok, out, counter = self._greedy
        s_tok.copy_(last[:, None])
        counter.zero_()
        for _ in range(steps):
            graph.replay()
        self.cache.ptr += steps
        self.cache.n_pending = 0
        return out[:, :steps].clone()

    def _capture_greedy(self, last: torch.Tensor) -> tuple:
        """One CUDA graph of a self-feeding greedy step; the cache state is left as it was."""
        cache = self.cache
        s_tok = last[:, None].clone()  # [batch, 1] the token fed in, then the argmax fed back
        out = torch.zeros(last.shape[0], cache.max_len, dtype=torch.long, device=self.device)  # [batch, steps]
        counter = torch.zeros(1, dtype=torch.long, device=self.device)
        slots = cache.write_slots  # the persistent width-1 slot buffer of begin(1)

        def step():
            torch.add(cache.arange[:1], cache.ptr_dev, out=slots)
            logits, _ = self.step_body(s_tok)  # [batch, 1, vocab]
            tok = logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
            s_tok.copy_(tok)
            out.index_copy_(1, counter, tok)
            cache.valid.index_fill_(1, cache.ptr_dev.view(1), True)
            cache.lengths.add_(1)
            cache.ptr_dev.add_(1)
            counter.add_(1)

        saved = (cache.valid.clone(), cache.lengths.clone(), cache.ptr_dev.clone(), s_tok.clone())

        def restore():
            for dst, src in zip((cache.valid, cache.lengths, cache.ptr_dev, s_tok), saved):
                dst.copy_(src)
            counter.zero_()

        graph, _ = self._capture_fn(step, after_each=restore)
        return graph, s_tok, out, counter

    def commit(self, keep: torch.Tensor, used: int | None = None) -> None:
        self.cache.commit(keep, used)

    def rollback(self, num: torch.Tensor) -> None:
        self.cache.rollback(num)

    def close(self) -> None:
        if self.capture is not None:
            self.capture.close()
