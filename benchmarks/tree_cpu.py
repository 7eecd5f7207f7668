"""Accepted tokens per round: EAGLE-2 draft trees of 8 and 16 verified tokens against chains of
k = 3, 5, 7, with one head on the held-out ShareGPT prompts (greedy, float32, batch 1).

    outrider demo --out demo                      # the CPU demo's head: demo/head
    python benchmarks/tree_cpu.py demo/head --json benchmarks/results/trees/cpu-trees.json

Acceptance only (the speed of a tree round on a CPU says nothing of a GPU's): each budget decodes
the same prompts with the same head; ``accepted`` is the mean accepted draft tokens per round
(tau - 1), ``tau`` the tokens per target forward. Every run is also compared token for token with
plain greedy decoding (``equal``), which trees must keep.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from outrider.bench.local import load_prompts
from outrider.decode.proposers import PROPOSERS
from outrider.interop.drafts import build_proposer
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.fsutil import write_json_output
from outrider.models import load_model
from outrider.trees import TreeBudget
from outrider.provenance import git_commit, today

CHAINS = (3, 5, 7)
TREES = ((2, 3, 8), (4, 2, 8), (2, 6, 16), (4, 3, 16), (4, 4, 16))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head", help="an EAGLE-3 head folder (the demo's: demo/head)")
    ap.add_argument("--target", default="default")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(a.target, device="cpu", dtype="float32")
    prompts = load_prompts(tok, "sharegpt", a.num_prompts)
    eos = eos_token_ids(model, tok)
    plain = SpecEngine(model, None, eos_ids=eos).generate(prompts, a.max_new_tokens).tokens
    rows = []
    settings = [("chain", k, None) for k in CHAINS] + [("tree", None, TreeBudget(*t)) for t in TREES]
    for kind, k, tree in settings:
        proposer = build_proposer("eagle3", PROPOSERS["eagle3"], model, tok, a.head, tree=tree)
        engine = SpecEngine(model, proposer, k=k or 1, eos_ids=eos)
        t0 = time.perf_counter()
        outs, steps, tokens = [], 0, 0
        for p in prompts:  # batch 1
            r = engine.generate([p], a.max_new_tokens)
            outs.extend(r.tokens)
            steps += r.row_steps
            tokens += r.new_tokens
        nodes, levels = proposer.round_shape(k or 1)
        tau = tokens / max(steps, 1)
        row = {"kind": kind, "k": k, **(tree.as_dict() if tree else {"topk": 1, "steps": k, "draft_tokens": k + 1}),
               "verified_tokens": nodes + 1, "tau": tau, "accepted": tau - 1, "rounds": steps,
               "equal": outs == plain, "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{kind:5} topk {row['topk']} steps {row['steps']} verified {row['verified_tokens']:2}: "
              f"accepted/round {row['accepted']:.3f} (tau {tau:.3f}), equal to greedy: {row['equal']}",
              file=sys.stderr)
    best = {n: max((r for r in rows if r["kind"] == "tree" and r["verified_tokens"] == n), key=lambda r: r["tau"])
            for n in (8, 16)}
    result = {"head": a.head, "target": a.target, "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
              "rows": rows, "best_tree": best, "device": "cpu", "dtype": "float32", "date": today(),
              "git_commit": git_commit()}
    print("| draft | topk | steps | verified tokens | accepted per round | tau | equal to greedy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['topk']} | {r['steps']} | {r['verified_tokens']} | {r['accepted']:.3f} | "
              f"{r['tau']:.3f} | {'yes' if r['equal'] else 'NO'} |")
    if a.json:
        write_json_output(a.json, result)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
