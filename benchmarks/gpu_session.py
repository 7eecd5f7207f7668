"""One GPU session on the default model, in two device calls that share /tmp.

    python benchmarks/gpu_session.py speed --out $OUT [--data-out /tmp/run/data --dataset F]
        decoding speed at batch 1: transformers ``generate`` (dynamic cache), our engine with CUDA
        graphs (eager kernels) and with CUDA graphs over a ``torch.compile``-fused step, the
        replay time of one graphed step alone (what the loop around it costs), transformers at its
        best (a ``StaticCache`` step under ``torch.compile(mode="reduce-overhead")``) on the same
        prompts; then, optionally, regenerates training data with the target.
    python benchmarks/gpu_session.py data --out $OUT --dataset F [--pack]
        only the regeneration (``--merge-base D``: then D and the new data merged into ``--merged``;
        ``--pack``: the data folder, or the merged one, comes back as ``$OUT/<its name>.tgz.NN`` parts;
        ``--regen-temperature T``: replies sampled at T; ``--skip-base-eval``: conversations of D's eval
        split are not regenerated, so that new replies to them never train).
    python benchmarks/gpu_session.py train-bench --out $OUT --data /tmp/run/data [--preset full]
        trains an EAGLE-3 head (or takes --head), then benchmarks n-gram and EAGLE-3 for k = 1..7
        against our autoregressive decode in the same run (engines built once per pass and
        reused across k); ``--ks ""`` trains only; ``--pack-head`` returns the head in parts.

Every stage writes ``$OUT/<phase>.json`` as soon as it ends; a stage that fails is recorded with
its error and the next one still runs. Prints a table per stage and one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from outrider.bench import _hf_generate, bench, load_prompts
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.fsutil import atomic_write_json
from outrider.models import load_model


def _dtype(a) -> str:
    return "bfloat16" if a.device == "cuda" else "float32"


def _device_name(a) -> str:
    return torch.cuda.get_device_name(0) if a.device == "cuda" else a.device


_FAILED: list[str] = []  # stages that raised: the process exits 1 at the end


def _stage(results: dict, name: str, path: Path, fn) -> None:
    t = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # a benchmark stage may fail; the others must still run and be recorded
        results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        _FAILED.append(name)
    results.setdefault("stage_s", {})[name] = round(time.perf_counter() - t, 2)
    atomic_write_json(path, results)
    print(f"== {name} ({results['stage_s'][name]:.1f} s):",
          json.dumps(results[name], default=str)[:1500], flush=True)


def _ours(model, prompts, max_new, eos, compile: bool, hf_outs=None):
    eng = SpecEngine(model, None, eos_ids=eos, graphs=True, compile=compile)
    t = time.perf_counter()
    eng.generate(prompts[:1], 8)  # capture (and compile) the one-token step
    warm_s = time.perf_counter() - t
    t = time.perf_counter()
    runs = [eng.generate([p], max_new) for p in prompts]
    eng._sync()
    s = time.perf_counter() - t
    n = sum(r.new_tokens for r in runs)
    decode_s = sum(r.decode_s for r in runs)
    steps = sum(r.steps for r in runs)
    out = {"tokens_per_s": n / s, "new_tokens": n, "warmup_s": warm_s,
           "step_ms": 1e3 * decode_s / steps, "verify_span_ms": 1e3 * sum(r.verify_s for r in runs) / steps,
           "prefill_ms_mean": 1e3 * sum(r.prefill_s for r in runs) / len(runs)}
    # the graph alone: replay the captured self-feeding greedy step back to back from an empty cache
    lm = next(iter(eng._pool.values()))
    graph, _, _, counter = lm._greedy
    lm.reset()
    lm.cache.ptr_dev.zero_()
    counter.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    end.synchronize()
    out["graph_replay_ms"] = start.elapsed_time(end) / 200
    lm.reset()
    outs = [r.tokens[0] for r in runs]
    if hf_outs is not None:
        out["agreement_with_hf"] = sum(a == b for a, b in zip(outs, hf_outs)) / len(outs)
    return out, outs


def _hf_static(model, prompts, max_new, eos, pad=None):
    """transformers at its best on its own: a ``StaticCache`` and a greedy one-token step compiled
    with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), the prefill eager, EOS checked
    after every token as ``generate`` does. Returns (figures, outputs)."""
    from transformers import StaticCache

    from outrider.decode.runner import cache_kwarg

    dev, kw = model.device, cache_kwarg(model)
    longest = max(len(p) for p in prompts)
    cache = StaticCache(config=model.config, max_cache_len=-(-(longest + max_new + 1) // 256) * 256)
    stop = set(eos)

    def one_token(tok, pos, cache_position):  # tok: [1, 1]; pos: [1, 1]; cache_position: [1]
        logits = model(input_ids=tok, position_ids=pos, cache_position=cache_position, use_cache=True,
                       **{kw: cache}).logits
        return logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]

    step = torch.compile(one_token, mode="reduce-overhead", fullgraph=True)

    def run(p, n):
        cache.reset()
        ids = torch.tensor([p], device=dev)
        logits = model(input_ids=ids, cache_position=torch.arange(len(p), device=dev), use_cache=True,
                       **{kw: cache}).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out = [int(tok)]
        t = time.perf_counter()
        while len(out) < n and out[-1] not in stop:
            at = torch.tensor([len(p) + len(out) - 1], device=dev)
            tok = step(tok, at[None], at).clone()
            out.append(int(tok))
        return out, time.perf_counter() - t, len(out) - 1

    with torch.no_grad():
        t = time.perf_counter()
        for _ in range(3):
            run(prompts[0], 16)  # compilation and graph capture
        warm = time.perf_counter() - t
        t = time.perf_counter()
        runs = [run(p, max_new) for p in prompts]
        s = time.perf_counter() - t
    outs = [o for o, _, _ in runs]
    steps = sum(n for _, _, n in runs)
    return {"tokens_per_s": sum(map(len, outs)) / s, "step_ms": 1e3 * sum(d for _, d, _ in runs) / max(steps, 1),
            "warmup_s": warm, "prompts": len(prompts)}, outs


def _parts(data: bytes, out: Path, name: str, part_bytes: int = 15 << 20) -> list[str]:
    """``data`` as ``out/name.NN`` files under the device's return limit (16 MiB a file): ``cat name.* > name``."""
    parts = []
    for i in range(0, len(data), part_bytes):
        part = out / f"{name}.{i // part_bytes:02d}"
        part.write_bytes(data[i:i + part_bytes])
        parts.append(part.name)
    return parts


def _pack(folder: str, out: str) -> dict:
    """``folder`` as ``out/<its name>.tgz.NN`` parts (``cat <name>.tgz.* | tar xz`` gives ``<its name>/``):
    what a later call carries back."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(folder, arcname=Path(folder).name)
    data = buf.getvalue()
    return {"packed": _parts(data, Path(out), f"{Path(folder).name}.tgz"), "packed_bytes": len(data)}


def _without_base_eval(a) -> tuple[str, int]:
    """``a.dataset`` less the conversations that ``a.merge_base``'s eval split holds an exchange of
    (ids ``X`` and ``X#...`` are conversation X; written next to ``a.data_out``), and how many went."""
    from outrider.fsutil import atomic_write_json
    from outrider.train.datasets import load_dataset

    held = {str(c).split("#")[0] for c in load_dataset(a.merge_base, "eval").conv_ids}
    records = json.loads(Path(a.dataset).read_text(encoding="utf-8"))
    kept = [r for r in records if str(r.get("id")).split("#")[0] not in held]
    path = f"{a.data_out}.source.json"
    atomic_write_json(Path(path), kept)
    return path, len(records) - len(kept)


def regenerate(a, model, eos) -> dict:
    """Token data from ``a.dataset`` with every assistant turn regenerated by the target (our engine,
    CUDA graphs; greedy, or sampled at ``a.regen_temperature``); packed into ``$OUT`` with ``a.pack``
    unless a merge follows."""
    from outrider.demo import engine_generate_fn
    from outrider.train.prepare import build_dataset

    t = time.perf_counter()
    dataset, skipped = _without_base_eval(a) if a.skip_base_eval else (a.dataset, 0)
    rep = build_dataset("default", dataset, a.data_out, max_conversations=a.conversations,
                        max_length=a.max_length, regenerate=True, max_new_tokens=a.regen_tokens,
                        eval_fraction=a.eval_fraction, temperature=a.regen_temperature,
                        generate_fn=engine_generate_fn(model, eos, batch_size=a.regen_batch, graphs=True,
                                                       temperature=a.regen_temperature),
                        progress=False)
    out = {"seconds": time.perf_counter() - t, "temperature": a.regen_temperature,
           "skipped_base_eval": skipped, **rep.to_dict()}
    return {**out, **_pack(a.data_out, a.out)} if a.pack and not a.merge_base else out


def data_phase(a) -> None:
    from outrider.train.datasets import merge_datasets

    model, tok = load_model("default", device=a.device, dtype=_dtype(a))
    results: dict = {}
    _stage(results, "data", Path(a.out) / "data.json", lambda: regenerate(a, model, eos_token_ids(model, tok)))
    if a.merge_base:
        def merge():
            m = merge_datasets([a.merge_base, a.data_out], a.merged)
            return {"out": a.merged, "counts": m["counts"],
                    **{f"{s}_tokens": m["splits"][s]["tokens"] for s in ("train", "eval")},
                    **(_pack(a.merged, a.out) if a.pack else {})}

        _stage(results, "merge", Path(a.out) / "data.json", merge)


def speed(a) -> None:
    path = Path(a.out) / "speed.json"
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    import transformers

    results["transformers"] = transformers.__version__
    model, tok = load_model("default", device="cuda", dtype="bfloat16")
    eos = eos_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    prompts = load_prompts(tok, a.prompts, a.num_prompts)
    store: dict = {}

    def hf():
        _hf_generate(model, prompts[:1], 1, 8, eos, pad)
        outs, s = _hf_generate(model, prompts[:a.hf_prompts], 1, a.max_new_tokens, eos, pad)
        store["hf"] = outs
        return {"tokens_per_s": sum(len(o) for o in outs) / s, "prompts": a.hf_prompts}

    _stage(results, "hf_generate", path, hf)

    def ours(compile):
        def run():
            out, outs = _ours(model, prompts, a.max_new_tokens, eos, compile, store.get("hf"))
            store["compiled" if compile else "eager"] = outs
            return out
        return run

    _stage(results, "ours_graphs", path, ours(False))
    _stage(results, "ours_graphs_compiled", path, ours(True))
    if "eager" in store and "compiled" in store:
        same = sum(x == y for x, y in zip(store["eager"], store["compiled"]))
        results["compiled_vs_eager_agreement"] = same / len(store["eager"])

    def hf_static():  # the same prompts as ours, right after ours
        out, outs = _hf_static(model, prompts, a.max_new_tokens, eos, pad)
        if "hf" in store:
            out["agreement_with_hf"] = sum(x == y for x, y in zip(outs, store["hf"])) / len(store["hf"])
        if "compiled" in store:
            out["agreement_with_ours_compiled"] = sum(x == y for x, y in zip(outs, store["compiled"])) / len(outs)
        return out

    if not a.skip_hf_static:
        _stage(results, "hf_static_compiled", path, hf_static)

    if a.dataset:
        _stage(results, "data", path, lambda: regenerate(a, model, eos))
    print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "trace"})
                      for k, v in results.items()}, default=str)[:6000])


def pack_head(head_dir: str | Path, out: Path, part_bytes: int = 15 << 20) -> dict:
    """The head as ``out/head.tar.NN`` parts under the device's return limit (16 MiB a file), its
    floating weights in bf16 (the engine runs a head in the target's dtype). Unpack with
    ``cat head.tar.* | tar x`` (a folder ``head/``)."""
    import io
    import tarfile

    from safetensors.torch import load_file, save

    tensors = load_file(str(Path(head_dir) / "model.safetensors"))
    blob = save({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted(Path(head_dir).iterdir()):
            if f.is_file() and f.name != "model.safetensors":
                tar.add(f, arcname=f"head/{f.name}")
        info = tarfile.TarInfo("head/model.safetensors")
        info.size, info.mtime = len(blob), int(time.time())
        tar.addfile(info, io.BytesIO(blob))
    data = buf.getvalue()
    return {"bytes": len(data), "parts": _parts(data, out, "head.tar", part_bytes)}


def _print_summary(results: dict) -> None:
    """The results without the bench's full records, as the call's last line."""
    print(json.dumps({k: v for k, v in results.items() if k != "records"}, default=str)[:6000])


def train_bench(a) -> None:
    from outrider.bench import build_proposer
    from outrider.heads.formats import export
    from outrider.train.trainer import train

    path = Path(a.out) / "train_bench.json"
    results: dict = {"device": _device_name(a)}
    model, tok = load_model("default", device=a.device, dtype=_dtype(a))
    eos = eos_token_ids(model, tok)
    head_dir = a.head or f"{a.work}/train/head"
    if not a.head:
        def run_train():
            rep = train("default", a.data, f"{a.work}/train", preset=a.preset, config=a.config, progress=False,
                        init=a.init, loaded_target=(model, tok))
            return rep.to_dict()

        _stage(results, "train", path, run_train)
        if "error" in results["train"]:  # what lies in the work folder is not this run's: send nothing back
            _print_summary(results)
            return
        (Path(a.out) / "train-metrics.jsonl").write_text((Path(a.work) / "train" / "metrics.jsonl").read_text())

        def run_export():
            return export(head_dir, "vllm", f"{a.work}/head-vllm", target="default").to_dict()

        _stage(results, "export", path, run_export)
        if a.pack_head:
            _stage(results, "pack_head", path, lambda: pack_head(head_dir, Path(a.out)))
    results["records"] = []
    ks = [int(x) for x in a.ks.split(",") if x]
    batches = [int(x) for x in a.batches.split(",") if x]
    for item in [x for x in a.passes.split(",") if x]:
        pass_name, _, methods = item.partition(":")
        compiled = pass_name.startswith("compiled")
        rounds = 0 if pass_name.endswith("-steps") else 8  # "-steps": one speculative step per synchronisation
        ar = SpecEngine(model, None, eos_ids=eos, graphs=True, compile=compiled)
        for method in [m for m in methods.split("+") if m and (m != "eagle3" or Path(head_dir).exists())]:
            draft = head_dir if method == "eagle3" else None
            proposer = build_proposer(method, model, tok, draft, device=model.device)
            spec = SpecEngine(model, proposer, k=1, eos_ids=eos, graphs=True, compile=compiled, rounds=rounds)
            for batch, k in [(b, k) for b in batches for k in ks]:
                def one():
                    r = bench("default", method, draft=draft, k=k, num_prompts=-(-a.num_prompts // batch) * batch,
                              prompts=a.prompts, max_new_tokens=a.max_new_tokens, batch_size=batch,
                              loaded=(model, tok), engines=(ar, spec), repeats=a.repeats,
                              log=lambda line: print(f"   {method} b{batch} k{k}: {line}", flush=True))
                    results["records"].append(r)
                    return {x: r[x] for x in ("compiled", "tau", "tokens_per_s", "ar_tokens_per_s", "speedup_vs_ar",
                                              "step_ms", "ar_step_ms", "verify_step_ms", "draft_step_ms",
                                              "propose_step_ms", "prompt_draft_ms", "prefill_ms", "ar_prefill_ms",
                                              "decode_speedup_vs_ar", "greedy_agreement")}
                _stage(results, f"{pass_name}_{method}_b{batch}_k{k}", path, one)
    if a.hf_static:
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        prompts = load_prompts(tok, a.prompts, a.hf_prompts)
        _stage(results, "hf_static_compiled", path, lambda: _hf_static(model, prompts, a.max_new_tokens, eos, pad)[0])
    _print_summary(results)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("speed", "data", "train-bench"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--hf-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--skip-hf-static", action="store_true")
    ap.add_argument("--dataset", default=None, help="speed phase: regenerate this conversation file")
    ap.add_argument("--data-out", default="/tmp/run/data")
    ap.add_argument("--pack", action="store_true",
                    help="data: the data folder (the merged one with --merge-base) comes back as "
                         "$OUT/<name>.tgz.NN parts")
    ap.add_argument("--merge-base", default=None, help="data: a dataset to merge the new one after (into --merged)")
    ap.add_argument("--merged", default="/tmp/run/data-all")
    ap.add_argument("--conversations", type=int, default=8000)
    ap.add_argument("--regen-tokens", type=int, default=256)
    ap.add_argument("--regen-batch", type=int, default=128)
    ap.add_argument("--regen-temperature", type=float, default=0.0, help="data: sample the replies at this "
                    "temperature (0: greedy)")
    ap.add_argument("--eval-fraction", type=float, default=0.05, help="data: the new data's eval share")
    ap.add_argument("--skip-base-eval", action="store_true", help="data: leave out the conversations of "
                    "--merge-base's eval split")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--data", default="/tmp/run/data")
    ap.add_argument("--work", default="/tmp/run")
    ap.add_argument("--preset", default="full")
    ap.add_argument("--config", default=None, help="a training config file instead of the preset")
    ap.add_argument("--init", default=None, help="train-bench: start the training from this head")
    ap.add_argument("--head", default=None, help="train-bench: bench this head instead of training one")
    ap.add_argument("--pack-head", action="store_true", help="train-bench: the trained head comes back as "
                    "$OUT/head.tar.NN (bf16 weights, parts under 16 MiB)")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7")
    ap.add_argument("--passes", default="eager:ngram+eagle3,compiled:eagle3+ngram",
                    help="train-bench: comma-separated PASS:METHOD+METHOD, PASS = eager (graphs of eager kernels) "
                         "or compiled (graphs of torch.compile-fused steps); a '-steps' suffix (compiled-steps) "
                         "runs greedy EAGLE-3 one step per host synchronisation instead of device rounds")
    ap.add_argument("--batches", default="1", help="train-bench: batch sizes, e.g. 1,4,16,64")
    ap.add_argument("--repeats", type=int, default=3, help="train-bench: (AR, method) pass pairs per row")
    ap.add_argument("--hf-static", action="store_true", help="train-bench: end with transformers' static-cache "
                    "compiled generate")
    ap.add_argument("--static-shapes", action="store_true", help="compiled steps specialise on every shape "
                    "(kv_cache.STATIC_SHAPES) instead of turning dynamic after a change")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="data, train-bench: 'cpu' (float32) for a dry run of a device session's scripts")
    a = ap.parse_args()
    if a.device == "cpu" and a.phase == "speed":
        raise SystemExit("the speed phase times CUDA graphs: it runs on cuda only")
    if a.skip_base_eval and not a.merge_base:
        ap.error("--skip-base-eval needs --merge-base (whose eval split it leaves out)")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.static_shapes:
        from outrider import kv_cache

        kv_cache.STATIC_SHAPES = True
    {"speed": speed, "data": data_phase, "train-bench": train_bench}[a.phase](a)
    if _FAILED:
        raise SystemExit(f"failed stages: {', '.join(_FAILED)} (their errors are in the results)")


if __name__ == "__main__":
    main()
