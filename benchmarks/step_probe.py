"""What one engine step costs on the GPU, by how its kernels are built; no weights needed.

    python benchmarks/step_probe.py --out $OUT [--widths 1,2,6] [--k 5] [--modes eager,dynamic,unfrozen,static]

A randomly initialised model of the default model's shape (SmolLM2-135M: 30 layers, hidden 576)
and a random EAGLE-3 head (draft vocabulary 32000): step costs do not depend on the weights;
``--head HEAD`` takes the default model itself and a trained head instead (drafts accepted).
For each mode of building the target's step,

    eager     CUDA graphs of eager kernels;
    dynamic   graphs of a ``torch.compile``-fused step, compiled as the engine does it (width 1
              first, later widths recompiled with dynamic shapes: ``dynamic=None``; weights
              frozen, projections of one input folded: ``kv_cache.FREEZE_WEIGHTS``);
    unfrozen  the same without frozen weights;
    static    graphs of a step compiled once per shape (``dynamic=False``), weights frozen;
    autotune  static, with inductor's GEMM autotuning (Triton templates against cuBLAS),

it times the replay of the target's graph per width (200 replays, CUDA events), then runs the
engine (plain greedy, and EAGLE-3 k chained drafts per round in device rounds and one step per
host synchronisation; ``--engine`` picks) and reports its per-step spans. With random weights
drafts are rejected, so the engine's figures are costs per round, not speedups. Writes
``$OUT/step-probe.json``; with ``--tables`` also the kernel table of each width's graph
(``$OUT/step-kernels-<mode>-w<n>.txt``) and its kernels per replay.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from outrider import kv_cache
from outrider.decode.engine import SpecEngine
from outrider.decode.proposers.eagle3 import Eagle3Proposer, _right_align
from outrider.fsutil import atomic_write_json
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head

REPLAYS = 200


def default_shape_model() -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval().requires_grad_(False)


def random_head(model: torch.nn.Module, draft_vocab: int = 32000) -> Eagle3Head:
    head = Eagle3Head(Eagle3Config.for_target(model.config, draft_vocab_size=draft_vocab))
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    head.set_vocab(torch.zeros(draft_vocab, dtype=torch.long), t2d)
    return head.cuda().to(torch.bfloat16).eval().requires_grad_(False)


def probe_models(head_path: str | None) -> tuple[torch.nn.Module, Eagle3Head]:
    """The default model's shape with random weights and a random head; with ``head_path`` the
    default model itself (``OUTRIDER_HOME``) and that trained head, whose drafts get accepted."""
    if head_path is None:
        model = default_shape_model()
        return model, random_head(model)
    from outrider.heads.checkpoint import load_head
    from outrider.models import load_model

    model, _ = load_model("default", device="cuda", dtype="bfloat16", with_tokenizer=False)
    head, _ = load_head(head_path, target_config=model.config)
    return (model.eval().requires_grad_(False),
            head.cuda().to(torch.bfloat16).eval().requires_grad_(False))


def _set_mode(mode: str) -> None:
    """Point the engine's shared compiled step at a fresh compilation for this mode."""
    torch._dynamo.reset()
    _ORIGINAL.cache_clear()
    kv_cache.FREEZE_WEIGHTS = mode != "unfrozen"
    if mode in ("static", "autotune"):
        step = kv_cache.compiled(kv_cache._plain_step, "inductor", dynamic=False)
        if mode == "autotune":
            step = _autotuned(step)
        kv_cache._compiled_step = lambda backend: step
    else:
        kv_cache._compiled_step = _ORIGINAL


def _autotuned(step):
    """``step`` compiled with inductor's GEMM autotuning (the setting must hold while it compiles)."""
    import torch._inductor.config as inductor

    def run(*args, **kwargs):
        with inductor.patch(max_autotune_gemm=True, max_autotune_gemm_backends="ATEN,TRITON"):
            return step(*args, **kwargs)

    return run


_ORIGINAL = kv_cache._compiled_step


def _timed(fn, n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def target_widths(model, mode: str, widths: list[int], prompt_len: int, aux, tables: Path | None) -> dict:
    lm = kv_cache.CachedLM(model, 1, 2048, aux_layer_ids=aux, graphs=True, compile=mode != "eager")
    ids = torch.randint(100, 40000, (1, prompt_len), device="cuda")
    lm.forward(ids, query_valid=torch.ones_like(ids, dtype=torch.bool))
    lm.commit(torch.ones_like(ids, dtype=torch.bool))
    out = {}
    for n in widths:
        t = time.perf_counter()
        lm.forward(ids[:, :n])  # capture (and compile) this width
        torch.cuda.synchronize()
        build_s = time.perf_counter() - t
        graph = lm._graphs[n][0]
        out[n] = {"replay_ms": _timed(graph.replay, REPLAYS), "build_s": round(build_s, 1)}
        if tables is not None:
            from draft_probe import _kernel_table

            table, out[n]["kernels"] = _kernel_table(graph.replay, 20, rows=100)
            (tables / f"step-kernels-{mode}-w{n}.txt").write_text(f"== {mode}, width {n}, 20 replays\n{table}")
        print(f"  {mode} width {n}: " + ", ".join(f"{a} {b}" for a, b in out[n].items()), flush=True)
    lm.close()
    return out


ENGINE_RUNS = {"ar": (False, 8), "eagle3-rounds": (True, 8), "eagle3-steps": (True, 0)}  # name -> (drafts, rounds)


def engine_spans(model, head, mode: str, k: int, prompt: list[int], max_new: int, names: list[str]) -> dict:
    compile = mode != "eager"
    out = {}
    for name in names:
        drafts, rounds = ENGINE_RUNS[name]
        kk = k if drafts else None
        prop = Eagle3Proposer(head, model) if kk else None
        if prop is not None and mode in ("static", "autotune"):
            prop._fused["inductor"] = tuple(kv_cache.compiled(f, "inductor", dynamic=False) for f in (
                prop._step_body, prop._draw_greedy, _right_align, prop._link_greedy))
        eng = SpecEngine(model, prop, k=kk or 4, graphs=True, compile=compile, rounds=rounds)
        t = time.perf_counter()
        eng.generate([prompt], 2 * (k + 1) * 9)  # capture (and compile) every graph of the run
        build_s = time.perf_counter() - t
        rs = [eng.generate([prompt], max_new) for _ in range(3)]
        steps = sum(r.steps for r in rs)
        out[name] = {"step_ms": 1e3 * sum(r.decode_s for r in rs) / steps,
                     "verify_ms": 1e3 * sum(r.verify_s for r in rs) / steps,
                     "draft_ms": 1e3 * sum(r.propose_s for r in rs) / steps,
                     "tau": sum(r.tau for r in rs) / len(rs), "build_s": round(build_s, 1)}
        print(f"  {mode} {name}: " + ", ".join(f"{a} {b:.3f}" for a, b in out[name].items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--widths", default="1,2,6")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--modes", default="eager,dynamic,unfrozen,static")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--engine", default=",".join(ENGINE_RUNS), help="engine runs per mode (empty: none)")
    ap.add_argument("--tables", action="store_true", help="write each width's kernel table")
    ap.add_argument("--head", default=None, help="a trained head: the default model itself and this head "
                    "instead of random weights")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, head = probe_models(a.head)
    aux = tuple(head.config.aux_layer_ids)
    prompt = torch.randint(100, 40000, (a.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for mode in a.modes.split(","):
        _set_mode(mode)
        print(f"== {mode}", flush=True)
        results[mode] = {"target_widths": target_widths(model, mode, [int(w) for w in a.widths.split(",")],
                                                        a.prompt_len, aux, out if a.tables else None)}
        atomic_write_json(out / "step-probe.json", results)
        results[mode]["engine"] = engine_spans(model, head, mode, a.k, prompt, a.max_new,
                                               [x for x in a.engine.split(",") if x])
        atomic_write_json(out / "step-probe.json", results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
