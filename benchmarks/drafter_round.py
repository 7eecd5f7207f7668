"""Drafting cost per round of the three drafters (issue 52): an EAGLE-3 chain (k head forwards),
P-EAGLE (one head forward over k positions) and DFlash (one forward of its layers over k + 1), at
the same k and batch, against the planner's price of the same round.

    python benchmarks/drafter_round.py                                     # CPU, float32
    python benchmarks/drafter_round.py --device cuda --dtype bfloat16 --graphs --compile \\
        --json benchmarks/results/gpu/drafter-round.json

The drafters are randomly initialised and sized for the target (DFlash with ``--dflash-layers``):
they accept little, which changes how many rounds a text takes but not what one round does. Each
setting decodes the same prompts and reports the milliseconds of drafting per round (the engine's
marks), the verification's, tau, and the lossless verdict against plain greedy decoding (exact, equal
up to near-ties or NO: ``outrider.bench.verdict``; in bf16 the verification's wider forward rounds
differently from plain decoding's one-token step); ``planned_draft_ms``
is the planner's draft-round price for the same shape on ``--hardware`` (a GPU profile; on the CPU
only the measured column means anything).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch
from tree_round import random_head

from outrider.bench.local import load_prompts, verdict_cell
from outrider.bench.verdict import judge
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.decode.proposers import PROPOSERS
from outrider.fsutil import write_json_output
from outrider.heads.dflash import DFlashConfig, DFlashDrafter
from outrider.models import arch_info, load_model
from outrider.plan.cost_model import dflash_shape, draft_round_cost, eagle3_head_shape
from outrider.plan.hardware import load_profile
from outrider.provenance import git_commit, today


def random_drafter(model: torch.nn.Module, layers: int, block: int, draft_vocab: int = 4096) -> DFlashDrafter:
    """A frozen, randomly initialised DFlash drafter for ``model`` (draft vocabulary: the first ids)."""
    torch.manual_seed(0)
    L = model.config.num_hidden_layers
    cfg = DFlashConfig.for_target(model.config, draft_vocab, mask_token_id=0, block_size=block, num_layers=layers,
                                  aux_layer_ids=(2, L // 2, L - 3))
    drafter = DFlashDrafter(cfg)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    drafter.set_vocab(torch.zeros(draft_vocab, dtype=torch.long), t2d)
    p = next(model.parameters())
    return drafter.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs where a proposer has them (EAGLE-3 chains)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the target's step and the drafting where a proposer fuses it (EAGLE-3, DFlash)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="3,5,7")
    ap.add_argument("--methods", default="eagle3,parallel,dflash")
    ap.add_argument("--dflash-layers", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts per batch row")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model, tok = load_model(a.target, device=a.device, dtype=a.dtype)
    eos = eos_token_ids(model, tok)
    ks = [int(k) for k in a.ks.split(",")]
    head = random_head(model)
    parallel = random_head(model, parallel_drafting=True, mask_token_id=0)
    drafter = random_drafter(model, a.dflash_layers, max(ks) + 1)
    drafts = {"eagle3": head, "parallel": parallel, "dflash": drafter}
    arch, hw = arch_info(model.config), load_profile(a.hardware)
    prices = {"eagle3": eagle3_head_shape(arch, 4096), "dflash": dflash_shape(arch, a.dflash_layers, 4096)}
    prices["parallel"] = replace(prices["eagle3"], method="parallel")
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        prompts = load_prompts(tok, "sharegpt", a.num_prompts * b)
        plain = SpecEngine(model, None, eos_ids=eos).generate(prompts, a.max_new_tokens).tokens
        for k in ks:
            for method, draft in ((m, drafts[m]) for m in a.methods.split(",")):
                engine = SpecEngine(model, PROPOSERS[method].build(model, draft), k=k, eos_ids=eos, graphs=a.graphs,
                                    compile=a.compile)
                best = None
                for rep in range(3):  # the first pass warms up (graphs, compilation); the best of two is kept
                    outs, steps, taus, propose, verify = [], 0, [], 0.0, 0.0
                    for i in range(0, len(prompts), b):
                        r = engine.generate(prompts[i:i + b], a.max_new_tokens)
                        outs.extend(r.tokens)
                        steps, taus = steps + r.steps, taus + [r.tau]
                        propose, verify = propose + r.propose_s, verify + r.verify_s
                    if rep and (best is None or propose < best[0]):
                        best = (propose, verify, steps, sum(taus) / len(taus), outs)
                propose, verify, steps, tau, outs = best
                planned = draft_round_cost(prices[method], hw, 1, k, b, 512).total_s
                verdict = judge(model, prompts, plain, [outs], k)
                row = {"method": method, "batch": b, "k": k, "rounds": steps, "tau": tau,
                       "draft_ms": 1e3 * propose / steps, "verify_ms": 1e3 * verify / steps,
                       "planned_draft_ms": 1e3 * planned, "equal_to_greedy": outs == plain, **verdict.record()}
                rows.append(row)
                print(f"b={b} k={k} {method:8}: draft {row['draft_ms']:.2f} ms per round (planned "
                      f"{row['planned_draft_ms']:.2f} on {a.hardware}), verify {row['verify_ms']:.2f}, tau "
                      f"{row['tau']:.2f}, lossless {row['verdict']}", file=sys.stderr)
    print(f"| batch | k | method | draft ms / round | planned ({a.hardware}) | verify ms | lossless |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['k']} | {r['method']} | {r['draft_ms']:.2f} | {r['planned_draft_ms']:.2f} | "
              f"{r['verify_ms']:.2f} | {verdict_cell(r)} |")
    if a.json:
        write_json_output(a.json, {"target": a.target, "dflash_layers": a.dflash_layers, "graphs": a.graphs,
                                   "compile": a.compile, "max_new_tokens": a.max_new_tokens, "rows": rows,
                                   "hardware_profile": a.hardware,
                                   "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
                                   "dtype": a.dtype, "date": today(), "git_commit": git_commit()})
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
