"""Does a compiled target step stay fast after the step's shape changes?

    python benchmarks/shape_change.py [--target default] [--num-prompts 8] [--max-new-tokens 64]
        [--dynamic] [--json F]

Plain greedy decoding through the engine with its default settings (on CUDA: CUDA graphs, the step
compiled with static shapes), timed per step; then speculative (n-gram) decoding at k = 3 and k = 5
in the same process, which compiles the shared step function at widths 4 and 6; then plain
decoding again. Prints the plain step's milliseconds before and after and their ratio (1.00: no
slower). ``--dynamic`` measures the same with shapes that turn dynamic after their first change,
for contrast. Writes a JSON record with ``--json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

import torch

from outrider.bench.local import load_prompts
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.decode.proposers.ngram import NgramProposer
from outrider.errors import UserError
from outrider.fsutil import write_json_output
from outrider.models import load_model
from outrider.ops.graphs import CompileOptions
from outrider.provenance import git_commit


def step_ms(engine: SpecEngine, prompts: list[list[int]], max_new: int) -> float:
    """Milliseconds per decoding step (prompt forwards left out), over the prompts one by one."""
    decode_s, steps = 0.0, 0
    for p in prompts:
        r = engine.generate([p], max_new)
        decode_s += r.decode_s
        steps += r.steps
    return 1e3 * decode_s / max(steps, 1)


def measure(model, tokenizer, prompts: list[list[int]], max_new: int, options: CompileOptions | bool) -> dict:
    eos = eos_token_ids(model, tokenizer)
    graphs = next(model.parameters()).device.type == "cuda"
    ar = SpecEngine(model, None, eos_ids=eos, graphs=graphs, compile=options)
    step_ms(ar, prompts[:1], max_new)  # warm-up: compilation and capture
    before = step_ms(ar, prompts, max_new)
    for k in (3, 5):  # other widths through the shared compiled step
        spec = SpecEngine(model, NgramProposer(), k=k, eos_ids=eos, graphs=graphs, compile=options)
        step_ms(spec, prompts[:2], max_new)
    after = step_ms(ar, prompts, max_new)
    return {"ar_step_ms_before": round(before, 4), "ar_step_ms_after": round(after, 4),
            "after_over_before": round(after / before, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dynamic", action="store_true", help="also measure shapes that turn dynamic, for contrast")
    ap.add_argument("--json", default=None, metavar="F")
    a = ap.parse_args(argv)
    try:
        model, tokenizer = load_model(a.target)
        prompts = load_prompts(tokenizer, "sharegpt", a.num_prompts)
    except UserError as e:
        print(f"shape_change: error: {e}", file=sys.stderr)
        return 2
    cuda = next(model.parameters()).device.type == "cuda"
    record = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "date": dt.date.today().isoformat(),
              "commit": git_commit(), "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
              "static": measure(model, tokenizer, prompts, a.max_new_tokens, CompileOptions() if cuda else False)}
    if a.dynamic:
        torch._dynamo.reset()
        record["dynamic"] = measure(model, tokenizer, prompts, a.max_new_tokens, CompileOptions(static_shapes=False))
    print(json.dumps(record))
    if a.json:
        write_json_output(a.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
