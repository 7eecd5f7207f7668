"""Cost of one speculative round, chain against tree: a topk-1 tree must cost what the chain of
the same k costs (issue 50), and a wider tree what its shape costs.

    python benchmarks/tree_round.py                                  # CPU, float32, a random head
    python benchmarks/tree_round.py --device cuda --dtype bfloat16 --graphs --compile \\
        --head demo/head --json benchmarks/results/gpu/tree-round.json   # on a GPU, the demo's head

Each setting decodes the same prompts (batch 1 unless ``--batch``) with the same EAGLE-3 head
(``--head``, or a randomly initialised one sized for the target: it accepts little, which changes
the cost of a round but not what a round does) and reports the milliseconds per round (decode
time over target forwards), split into drafting and verification as the engine's marks measure
them, with tau and whether the tokens equal plain greedy decoding. A topk-1 tree and the chain
of the same k must also emit identical tokens (``same_as_chain``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from outrider.bench.local import load_prompts
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.decode.proposers import PROPOSERS
from outrider.interop.drafts import build_proposer
from outrider.fsutil import write_json_output
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.models import load_model
from outrider.trees import TreeBudget
from outrider.provenance import git_commit, today

TREES = ((1, 3, 4), (1, 5, 6), (2, 3, 8), (4, 2, 8), (4, 3, 16), (4, 4, 16))


def random_head(model: torch.nn.Module, draft_vocab: int = 4096, seed: int = 0, **options) -> Eagle3Head:
    """A frozen, randomly initialised EAGLE-3 head sized for ``model`` (its draft vocabulary the
    target's first ``draft_vocab`` ids; ``options``: ``Eagle3Config.for_target``'s, e.g. P-EAGLE's)."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(model.config, draft_vocab_size=draft_vocab, **options))
    V = model.config.vocab_size
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:draft_vocab] = True
    head.set_vocab(torch.zeros(draft_vocab, dtype=torch.long), t2d)
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    return head.to(device=dev, dtype=dtype).eval().requires_grad_(False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--head", default=None, help="an EAGLE-3 head folder (default: a random head)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (chains; trees where they apply)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the target's step")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="timed passes (the best is kept) after one warm-up")
    ap.add_argument("--trees", default=";".join(",".join(map(str, t)) for t in TREES))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(a.target, device=a.device, dtype=a.dtype)
    prompts = load_prompts(tok, "sharegpt", a.num_prompts * a.batch)
    eos = eos_token_ids(model, tok)
    head = random_head(model) if a.head is None else None
    plain = SpecEngine(model, None, eos_ids=eos).generate(prompts, a.max_new_tokens).tokens
    trees = [TreeBudget.parse(t) for t in a.trees.split(";") if t.strip()]
    settings = [("chain", t.steps, None) for t in trees if t.topk == 1] + [("tree", None, t) for t in trees]
    rows, chains = [], {}
    for kind, k, tree in settings:
        if head is None:
            proposer = build_proposer("eagle3", PROPOSERS["eagle3"], model, tok, a.head, tree=tree)
        else:
            proposer = PROPOSERS["eagle3"].build(model, head, **({"tree": tree} if tree else {}))
        engine = SpecEngine(model, proposer, k=k or 1, eos_ids=eos, graphs=a.graphs, compile=a.compile)
        best = None
        for rep in range(1 + a.repeats):  # the first pass warms up (graphs, compilation)
            outs, steps, tokens, decode, propose, verify = [], 0, 0, 0.0, 0.0, 0.0
            for i in range(0, len(prompts), a.batch):
                r = engine.generate(prompts[i:i + a.batch], a.max_new_tokens)
                outs.extend(r.tokens)
                steps += r.steps
                tokens += r.new_tokens
                decode, propose, verify = decode + r.decode_s, propose + r.propose_s, verify + r.verify_s
            if rep and (best is None or decode < best[0]):
                best = (decode, propose, verify)
        decode, propose, verify = best
        shape = tree.as_dict() if tree else {"topk": 1, "steps": k, "draft_tokens": k + 1}
        row = {"kind": kind, **shape, "rounds": steps, "tau": tokens / max(steps, 1) / a.batch,
               "ms_per_round": 1e3 * decode / steps, "draft_ms": 1e3 * propose / steps,
               "verify_ms": 1e3 * verify / steps, "equal_to_greedy": outs == plain}
        if kind == "chain":
            chains[k] = outs
        elif tree.topk == 1:
            row["same_as_chain"] = outs == chains.get(tree.steps)
        rows.append(row)
        print(f"{kind:5} {shape['topk']},{shape['steps']},{shape['draft_tokens']:2}: {row['ms_per_round']:7.2f} ms "
              f"per round (draft {row['draft_ms']:.2f}, verify {row['verify_ms']:.2f}), tau {row['tau']:.3f}, "
              f"equal to greedy {row['equal_to_greedy']}" + (f", same as the chain {row['same_as_chain']}"
                                                             if "same_as_chain" in row else ""), file=sys.stderr)
    print("| draft | topk,steps,tokens | ms per round | draft ms | verify ms | tau | equal to greedy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['topk']},{r['steps']},{r['draft_tokens']} | {r['ms_per_round']:.2f} | "
              f"{r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['tau']:.3f} | {'yes' if r['equal_to_greedy'] else 'NO'} |")
    for r in rows:
        if "same_as_chain" in r:
            chain = next(c for c in rows if c["kind"] == "chain" and c["steps"] == r["steps"])
            print(f"topk-1 tree / chain of k = {r['steps']}: {r['ms_per_round'] / chain['ms_per_round']:.2f}x per "
                  f"round, identical tokens: {r['same_as_chain']}")
    if a.json:
        write_json_output(a.json, {"target": a.target, "head": a.head or "random", "batch": a.batch,
                                   "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
                                   "graphs": a.graphs, "compile": a.compile, "rows": rows,
                                   "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
                                   "dtype": a.dtype, "date": today(), "git_commit": git_commit()})
    return 0 if all(r["equal_to_greedy"] and r.get("same_as_chain", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
