"""CUDA graphs and ``torch.compile`` for inference steps: capture helpers and the compile policy.

Contract: ``capture_graph`` warms a function up on a side stream and captures one call, the
cyclic garbage collector held off meanwhile (``collector_off``);
``graph_kernels`` switches a model to kernels a captured step can record (batched experts, slot
attention); ``graphable`` says whether a many-token forward with one explicit mask is exact under
a graph. ``CompileOptions`` is the compile policy (backend, static shapes, frozen weights), an
argument of every object that compiles a step (``CachedLM``, ``SpecEngine``, proposers), never a
module global; ``compiled`` applies it."""

from __future__ import annotations

import contextlib
import functools
import gc
from dataclasses import dataclass
from typing import Any, Callable

import torch

from outrider.models import arch_info
from outrider.ops.slot_attention import supports, using_slot_attention


@contextlib.contextmanager
def graph_safe_experts(model: torch.nn.Module):
    """Mixture-of-experts layers without host synchronisation while a CUDA graph is captured.

    ``transformers``' ``grouped_mm`` experts copy group offsets through the host, which graph
    capture forbids; ``batched_mm`` (gathering each token's experts) has none, and is what
    ``transformers`` itself switches to for decoding on GPUs. Dense models pass through.
    """
    get = getattr(model, "get_experts_implementation", None)
    original = get() if callable(get) else None
    switch = isinstance(original, dict) and "grouped_mm" in original.values()
    if switch:
        model.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in original.items()})
    try:
        yield
    finally:
        if switch:
            model.set_experts_implementation(original)


@contextlib.contextmanager
def graph_kernels(model: torch.nn.Module, slots: bool = True):
    """The kernels a captured step of ``model`` records: batched experts (``graph_safe_experts``)
    and, with ``slots``, ``slot_attention`` for its few new queries over the whole slot buffer
    (cheaper than the model's own attention for a step's few queries: benchmarks/RESULTS.md)."""
    with graph_safe_experts(model), using_slot_attention(model, slots):
        yield


@contextlib.contextmanager
def collector_off():
    """Python's cyclic garbage collector held off, its former state restored after. A collection
    during a CUDA graph's capture may free a dead graph (an earlier engine's, in a reference cycle),
    whose reset is not permitted while a stream captures: that invalidates the capture. (torch no
    longer collects on entering a capture: ``torch.compiler.config.force_cudagraph_gc``.)"""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def capture_graph(fn: Callable[[], Any], device: torch.device, warmups: int, pool=None,
                  after_each: Callable[[], Any] | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``fn`` ``warmups`` times on a side stream (``after_each`` after every run), then
    capture one call as a CUDA graph; returns the graph and the call's (static) outputs."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
            if after_each is not None:
                after_each()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def graphable(target: torch.nn.Module) -> bool:
    """Whether a graphed forward over many new tokens with one explicit mask computes what the
    target's own does: a dense target whose every layer attends causally over the full context (a
    mixture of experts routes through the host or by data-dependent shapes)."""
    cfg = getattr(target.config, "text_config", None) or target.config
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    return (supports(target) and kinds == {"full_attention"} and not arch_info(cfg).is_moe
            and not getattr(cfg, "attention_chunk_size", None))
@dataclass(frozen=True)
class CompileOptions:
    """How ``torch.compile`` fuses an inference step (an argument of whatever compiles one).

    ``static_shapes``: one compilation per shape (width, batch, cache size), each as fast as the
    first; off, shapes turn dynamic after their first change (fewer compilations, but a dynamic
    step can be many times slower: the default on CUDA is static). ``freeze_weights`` (inductor
    only): the weights become constants of the compiled code, so that inductor folds the
    projections that read one input into one matrix product (query/key/value, gate/up: 4 instead
    of 7 per Llama layer; launches, not bytes, dominate a small batch's step). The folded weights
    are copies, one set per compiled variant: turn it off for a target whose weights barely fit;
    changing the model's weights afterwards does not reach a frozen step.
    """

    backend: str = "inductor"
    static_shapes: bool = True
    freeze_weights: bool = True


def compile_options(compile: "bool | str | CompileOptions | None") -> CompileOptions | None:
    """The options a ``compile`` setting names: False/None = eager (None returned), True = inductor
    with the defaults, a string = that backend with the defaults, or the options themselves."""
    if isinstance(compile, CompileOptions):
        return compile
    if not compile:
        return None
    return CompileOptions(backend=compile if isinstance(compile, str) else "inductor")


def compiled(fn: Callable, options: CompileOptions, dynamic: bool | None = None) -> Callable:
    """``fn`` compiled by ``torch.compile`` under ``options``; ``dynamic=True`` makes every size
    dynamic from the start (for calls whose sizes always vary), overriding ``static_shapes``. The
    recompilation limit is raised for the widths and batch sizes we use."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if dynamic is None and options.static_shapes:
        dynamic = False
    step = torch.compile(fn, backend=options.backend, dynamic=dynamic, fullgraph=False)
    if options.backend != "inductor" or not options.freeze_weights:
        return step

    @functools.wraps(fn)
    def frozen(*args, **kwargs):
        # the setting must hold while dynamo traces (it decides there how weights enter the graph),
        # not only while inductor compiles: a torch.compile option would come too late
        with torch._inductor.config.patch(freezing=True):
            return step(*args, **kwargs)

    return frozen
