#!/usr/bin/env bash
# EAGLE-3, P-EAGLE and DFlash side by side: each trained on the same data for the same optimizer
# steps (the preset's, no time budget), then benched on the same held-out prompts at batch 1 and 8,
# greedy, k draft tokens per round (every draft checked lossless against plain decoding).
#
#   bash benchmarks/drafters_compare.sh OUT_DIR [K]        (from the repository root; no network needed)
#
# The data is OUT_DIR/demo/data, the demo's data stage alone (`outrider.demo.demo_data`: quick
# preset on a CPU, full on CUDA) when missing. STEPS (default: the preset's) sets the optimizer
# steps of all three. DFlash trains blocks of K + 1 (K drafts per forward, as the others' K
# unrolled steps) with dflash_layers DFLASH_LAYERS (default 1); DFLASH_INIT=1 starts its lm_head and
# final norm from the target's (init_from_target), DFLASH_FREEZE=1 as well and keeps that lm_head
# frozen (freeze_lm_head, as DFlash's reference trainers do); DFLASH_LABELS=target trains it on the
# target's distributions (dflash_labels); DFLASH_KV_HEADS gives it its own key/value heads
# (dflash_kv_heads; default 0, the target's); DFLASH_GAMMA weighs its draft i by exp(-i / gamma)
# (loss_decay_gamma; default the paper's for the block). Default K: 3 on a CPU (the quick
# preset's unroll), 5 on CUDA. TREES (e.g. "4,3,16 4,4,16") also benches the EAGLE-3 head's
# EAGLE-2 trees at batch 1. PROMPTS and TOKENS: held-out prompts and new tokens each (32 x 128 on
# CUDA, 16 x 48 on a CPU). METHODS (default "eagle3 parallel dflash") and BATCHES (default "1 8")
# narrow the run to some drafters and batch sizes. The benches run in one process
# (benchmarks/drafters_bench.py).
# Records: OUT_DIR/bench-METHOD-bB-kK.json (trees: -tree-T-S-N); the table: OUT_DIR/table.md.
set -euo pipefail

out=${1:?usage: bash benchmarks/drafters_compare.sh OUT_DIR [K]}
methods=${METHODS:-eagle3 parallel dflash}
batches=${BATCHES:-1 8}
flags() {  # flags DRAFTER: its `outrider train` flags; an unknown drafter refused in one line
  case $1 in
    eagle3) ;; parallel) echo --parallel-drafting;; dflash) echo --drafter dflash;;
    *) echo "METHODS: unknown drafter '$1' (eagle3, parallel, dflash)" >&2; return 2;;
  esac
}
for m in $methods; do flags "$m" > /dev/null || exit 2; done
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
cuda=$(python -c 'import torch; print(int(torch.cuda.is_available()))')
k=${2:-$([ "$cuda" = 1 ] && echo 5 || echo 3)}
layers=${DFLASH_LAYERS:-1}
if [ "$cuda" = 1 ]; then prompts=${PROMPTS:-32}; tokens=${TOKENS:-128}; else prompts=${PROMPTS:-16}; tokens=${TOKENS:-48}; fi

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  python -c 'from outrider.provenance import git_commit; print(git_commit() or "no git")'  # -dirty: not the commit's tree
  python -c 'import torch, platform; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu", "torch", torch.__version__)'
  echo "methods=$methods batches=$batches"
  echo "k=$k dflash_layers=$layers dflash_init=${DFLASH_INIT:-0} dflash_freeze=${DFLASH_FREEZE:-0} dflash_labels=${DFLASH_LABELS:-tokens} dflash_kv_heads=${DFLASH_KV_HEADS:-0} dflash_gamma=${DFLASH_GAMMA:-default} prompts=$prompts max_new_tokens=$tokens"
} > "$out/env.txt"

[ -f "$out/demo/data/manifest.json" ] || python -c 'import sys; from outrider.demo import demo_data; demo_data(sys.argv[1])' "$out/demo"
steps=$(python - "$k" "$layers" "$out" "${STEPS:-0}" "${DFLASH_INIT:-0}" "${DFLASH_FREEZE:-0}" "${DFLASH_LABELS:-tokens}" "${DFLASH_KV_HEADS:-0}" "${DFLASH_GAMMA:-}" <<'EOF'
import json, sys
from outrider.config import TrainConfig
import torch
k, layers, out, steps, init, freeze = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                        sys.argv[5] == "1" or sys.argv[6] == "1", sys.argv[6] == "1")
base = TrainConfig.preset("full" if torch.cuda.is_available() else "quick")
if steps:
    base = base.replace(steps=steps, warmup_steps=min(base.warmup_steps, steps // 10))
common = {"time_budget_s": 0, "ttt_steps": k, "tau_k": k, "steps": base.steps, "warmup_steps": base.warmup_steps}
json.dump(common, open(f"{out}/eagle3.json", "w"))
json.dump(common, open(f"{out}/parallel.json", "w"))
json.dump({**common, "block_size": k + 1, "dflash_layers": layers, **({"init_from_target": True} if init else {}),
           **({"freeze_lm_head": True} if freeze else {}), "dflash_labels": sys.argv[7],
           "dflash_kv_heads": int(sys.argv[8]), **({"loss_decay_gamma": float(sys.argv[9])} if sys.argv[9] else {})},
          open(f"{out}/dflash.json", "w"))
print(base.steps)
EOF
)
echo "training each drafter for $steps optimizer steps" | tee -a "$out/env.txt"

train() {  # train NAME FLAGS...
  local name=$1
  shift
  [ -f "$out/$name/head/config.json" ] && return 0
  python -m outrider train default --data "$out/demo/data" --out "$out/$name" --config "$out/$name.json" "$@" \
    2>&1 | tee "$out/train-$name.log"
}
for m in $methods; do train "$m" $(flags "$m"); done

runs=()
for b in $batches; do
  for m in $methods; do runs+=(--run "$m:$out/$m/head:k=$k:b=$b"); done
done
for t in ${TREES:-}; do runs+=(--run "eagle3:$out/eagle3/head:tree=$t"); done
python benchmarks/drafters_bench.py --out "$out" --num-prompts "$prompts" --max-new-tokens "$tokens" "${runs[@]}" \
  2>&1 | tee "$out/bench.log"

python - "$out" "$k" "$methods" "$batches" <<'EOF' | tee "$out/table.md"
import json, sys
from pathlib import Path
from outrider.records import read_records
out = Path(sys.argv[1])
print("| method | batch | k | tau | draft ms / round | verify ms | tokens/s | speedup vs AR | lossless |")
print("|---|---|---|---|---|---|---|---|---|")
methods, batches = sys.argv[3].split(), [int(b) for b in sys.argv[4].split()]
files = [(m, b, out / f"bench-{m}-b{b}-k{sys.argv[2]}.json") for b in batches for m in methods]
files += [("eagle3 tree " + f.stem.split("tree-")[1].replace("-", ","), 1, f)
          for f in sorted(out.glob("bench-eagle3-b1-tree-*.json"))]
for m, b, f in files:
    (r,) = read_records(f)
    print(f"| {m} | {b} | {r.k} | {r.tau:.2f} | {r['draft_step_ms']:.2f} | {r['verify_step_ms']:.2f} | "
          f"{r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | {r['verdict']} |")
for m in methods:
    evals = [json.loads(l) for l in (out / m / "metrics.jsonl").read_text().splitlines()]
    last = [e for e in evals if e.get("type") == "eval"][-1]
    print(f"\n{m}: step {last['step']}, walked tau@{len(last['per_step_acc'])} on the eval split "
          f"{last.get('walk_tau_k', float('nan')):.3f}, per-step accuracy {[round(a, 3) for a in last['per_step_acc']]}")
EOF
