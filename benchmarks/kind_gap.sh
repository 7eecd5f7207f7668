#!/usr/bin/env bash
# How a head's walked tau depends on the kind of prompt: first exchanges against later user turns alone.
#
#   bash benchmarks/kind_gap.sh OUT            (env: FIRST, SINGLE, STEPS, EXAMPLES, K, NEW)
#
# The `long` demo trains on every first exchange and, four in five, later user turns each alone
# (sharegpt.training_exchanges(single=...)); its eval split mixes both, while the bench's prompts are
# first turns of held-out conversations. Here: FIRST first exchanges and SINGLE singles regenerated
# greedily by the default target (NEW new tokens), split by opening as the demo's data is, a head
# trained STEPS steps on it (quick preset), then its walked tau (benchmarks/walk_check.py
# --no-engine: on the target's greedy continuation of each prompt, NEW tokens) on the eval split's
# first exchanges, its later turns, and held-out prompts. Each stage's output is kept: a rerun resumes.
set -euo pipefail
OUT=${1:?usage: bash benchmarks/kind_gap.sh OUT}
FIRST=${FIRST:-150} SINGLE=${SINGLE:-150} STEPS=${STEPS:-800} EXAMPLES=${EXAMPLES:-20} K=${K:-3} NEW=${NEW:-96}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
if [ ! -f "$OUT/exchanges.json" ]; then
  python - "$OUT/exchanges.json" "$FIRST" "$SINGLE" <<'EOF'
import sys
from pathlib import Path
from outrider import assets, sharegpt
from outrider.fsutil import atomic_write_json
corpus = sharegpt.load_sharegpt(assets.sharegpt_path(pulled=True))
atomic_write_json(Path(sys.argv[1]), sharegpt.training_exchanges(corpus, int(sys.argv[2]), single=int(sys.argv[3])))
EOF
fi
[ -f "$OUT/data/manifest.json" ] || outrider data default --dataset "$OUT/exchanges.json" --out "$OUT/data" \
  --regenerate --max-new-tokens "$NEW" --max-length 384 --eval-fraction 0.2 --quiet
echo "{\"steps\": $STEPS, \"eval_examples\": 64, \"eval_every\": $STEPS, \"save_every\": $STEPS}" > "$OUT/config.json"
[ -f "$OUT/train/head/config.json" ] || outrider train default --data "$OUT/data" --out "$OUT/train" \
  --preset quick --config "$OUT/config.json"
for t in first later; do
  [ -f "$OUT/walk-$t.json" ] || python "$HERE/walk_check.py" --head "$OUT/train/head" --data "$OUT/data" \
    --texts "$t" --examples "$EXAMPLES" --k "$K" --max-new "$NEW" --no-engine --out "$OUT/walk-$t.json"
done
[ -f "$OUT/walk-heldout.json" ] || python "$HERE/walk_check.py" --head "$OUT/train/head" --prompts sharegpt \
  --examples "$EXAMPLES" --k "$K" --max-new "$NEW" --no-engine --out "$OUT/walk-heldout.json"
python "$HERE/walk_table.py" "$OUT"
