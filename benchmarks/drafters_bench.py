"""Bench several drafters (and trees) on one target loaded once: one ``outrider bench`` record per run.

    python benchmarks/drafters_bench.py --out DIR --run eagle3:HEAD_DIR[:k=5][:b=1] [--run ...]
        [--run eagle3:HEAD_DIR:tree=4,3,16] [--num-prompts 32] [--max-new-tokens 128]

Each ``--run`` is ``METHOD:DRAFT`` with options ``k=K`` (default 5), ``b=BATCH`` (default 1) and
``tree=TOPK,STEPS,TOKENS`` (an EAGLE-2 budget, method eagle3). Every run is ``outrider.bench.local.bench``
as ``outrider bench`` calls it (the same prompts, its own autoregressive passes beside it, the
lossless verdict), with the target loaded once for all of them, so a sweep pays one load and the
compiled target's warm caches; its record goes to ``DIR/bench-METHOD-bB-kK.json`` (a chain) or ``DIR/bench-METHOD-bB-tree-T-S-N.json``.
Prints one table row per run.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from outrider.bench.local import bench
from outrider.errors import UserError
from outrider.models import load_model
from outrider.records import write_records
from outrider.trees import TreeBudget


def parse_run(text: str) -> dict:
    """``METHOD:DRAFT[:k=K][:b=B][:tree=T,S,N]`` -> bench arguments and the record's file stem."""
    method, _, rest = text.partition(":")
    parts = rest.split(":")
    n_opts = 0  # the options end the text; a ':' before them belongs to the draft's path
    while n_opts < len(parts) - 1 and re.fullmatch(r"(k|b|tree)=.*", parts[len(parts) - 1 - n_opts]):
        n_opts += 1
    draft = ":".join(parts[:len(parts) - n_opts])
    if not method or not draft:
        raise UserError(f"--run takes METHOD:DRAFT[:k=K][:b=B][:tree=T,S,N], got {text!r}")
    run = {"method": method, "draft": draft, "k": 5, "batch_size": 1, "tree": None}
    for opt in parts[len(parts) - n_opts:]:
        name, _, value = opt.partition("=")
        try:
            if name == "k":
                run["k"] = int(value)
            elif name == "b":
                run["batch_size"] = int(value)
            elif name == "tree":
                run["tree"] = TreeBudget.parse(value)
            else:
                raise ValueError(name)
        except (TypeError, ValueError):
            raise UserError(f"--run {text!r}: bad option {opt!r} (k=K, b=B or tree=TOPK,STEPS,TOKENS)") from None
    shape = "tree-" + "-".join(map(str, run["tree"].shape())) if run["tree"] else f"k{run['k']}"
    run["stem"] = f"bench-{run['method']}-b{run['batch_size']}-{shape}"
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--run", action="append", required=True)
    ap.add_argument("--target", default="default")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    try:
        runs = [parse_run(r) for r in a.run]
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        loaded = load_model(a.target)
        print("| run | tau | draft ms / round | verify ms | tokens/s | AR tokens/s | speedup vs AR | verdict |")
        print("|---|---|---|---|---|---|---|---|")
        for run in runs:
            r = bench(a.target, run["method"], draft=run["draft"], k=run["k"], tree=run["tree"],
                      batch_size=run["batch_size"], num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens,
                      loaded=loaded)
            write_records(out / f"{run['stem']}.json", [r])
            print(f"| {run['stem']} | {r['tau']:.2f} | {r['draft_step_ms']:.2f} | {r['verify_step_ms']:.2f} | "
                  f"{r['tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                  f"{r.get('verdict', '-')} |", flush=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
