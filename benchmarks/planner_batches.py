"""Lockstep batches: our engine's measured speedup at batches 1, 4, 16, 64 against the planner's, in one run.

    python benchmarks/planner_batches.py --out DIR [--draft HEAD] [--k 5] [--batches 1,4,16,64]
        [--num-prompts 64] [--max-new-tokens 128] [--prompts sharegpt|FILE] [--compile] [--device cuda]

Loads the default target once and builds one plain and one speculative engine (EAGLE-3 with
``--draft HEAD``; n-gram when no head is given or the folder is missing), then runs ``outrider
bench`` at each batch size on the same prompts (batch 1 first: its per-prompt tau and verify steps
are the rows the planner draws from). Against each measured decode speedup it sets:
- ``lockstep, these batches``: ``batching.RoundsModel.of_rows`` on the prompts each batch actually
  held (their batch-1 acceptance and lengths), with that batch size's measured step costs: the
  lockstep term alone;
- ``planner``: ``outrider plan default --acceptance <batch-1 record> --calibrate <all records>
  --batching lockstep``: step costs from the cost model fitted to every record's step times (never to
  a speedup), rows drawn from the batch-1 spread;
- ``no lockstep term``: the same plan with continuous batching (what the planner said before).
Plain decoding syncs every ``AR_CHUNK`` steps, so a batch whose last row ends at EOS runs to the end
of its chunk: the first comparison counts that. Writes ``DIR/planner_batches.json`` (records,
rows, device, date, commit, command) and prints a table. On a CPU use a tiny ``--num-prompts``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path

import torch

from outrider.bench.local import bench
from outrider.decode.proposers import PROPOSERS
from outrider.interop.drafts import build_proposer
from outrider.provenance import git_commit
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.fsutil import atomic_write_json
from outrider.models import load_model
from outrider.plan.validate import lockstep_rows, planner_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--draft", default=None, help="an EAGLE-3 head folder; without one, n-gram")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default="sharegpt", help="'sharegpt' (held-out first turns) or a .json/.txt file")
    ap.add_argument("--compile", action="store_true", help="fuse the steps with torch.compile (a compilation per "
                    "batch size: minutes more)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    batches = sorted({int(x) for x in a.batches.split(",") if x.strip()} | {1})
    started = time.perf_counter()
    model, tok = load_model("default", device=a.device)
    dev = next(model.parameters()).device
    method = "eagle3" if a.draft and Path(a.draft).exists() else "ngram"
    draft = a.draft if method == "eagle3" else None
    if a.draft and method == "ngram":
        print(f"no head at {a.draft}: n-gram instead", file=sys.stderr)
    graphs = dev.type == "cuda"
    eos = eos_token_ids(model, tok)
    ar = SpecEngine(model, None, eos_ids=eos, graphs=graphs, compile=a.compile)
    proposer = build_proposer(method, PROPOSERS[method], model, tok, draft, device=dev)
    spec = SpecEngine(model, proposer, k=a.k, eos_ids=eos, graphs=graphs, compile=a.compile)
    records: dict[int, dict] = {}
    for b in batches:
        num = -(-a.num_prompts // b) * b  # whole batches
        records[b] = bench("default", method, draft=draft, k=a.k, num_prompts=num, max_new_tokens=a.max_new_tokens,
                           batch_size=b, prompts=a.prompts, loaded=(model, tok), engines=(ar, spec),
                           repeats=a.repeats, log=lambda line, b=b: print(f"  batch {b}: {line}", flush=True))
    rows = lockstep_rows(records, a.max_new_tokens, SpecEngine.AR_CHUNK)
    lock = planner_rows(records, "lockstep", a.max_new_tokens)
    cont = planner_rows(records, "continuous", a.max_new_tokens)
    print(f"{method} k={a.k}, {a.num_prompts} prompts x {a.max_new_tokens} new tokens, "
          f"{records[1]['device']}, {records[1]['dtype']}, compiled {bool(a.compile)}")
    print("| batch | tau | AR step ms | round ms | measured decode speedup | lockstep, these batches | error | "
          "planner (lockstep) | error | no lockstep term | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        b, r = row["batch"], records[row["batch"]]
        m = r["decode_speedup_vs_ar"]
        row.update(measured=m, planner_lockstep=lock[b], planner_continuous=cont[b], tau=r["tau"],
                   lockstep_error=row["lockstep_speedup"] / m - 1, planner_error=lock[b] / m - 1,
                   continuous_error=cont[b] / m - 1)
        print(f"| {b} | {r['tau']:.2f} | {r['ar_step_ms']:.3f} | {r['step_ms']:.3f} | {m:.3f}x | "
              f"{row['lockstep_speedup']:.3f}x | {100 * row['lockstep_error']:+.1f} % | {lock[b]:.3f}x | "
              f"{100 * row['planner_error']:+.1f} % | {cont[b]:.3f}x | {100 * row['continuous_error']:+.1f} % |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "planner_batches.json", {
        "device": records[1]["device"], "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "commit": git_commit(), "command": " ".join(sys.argv), "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1), "rows": rows, "records": list(records.values())})
    print(f"wrote {out / 'planner_batches.json'} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
