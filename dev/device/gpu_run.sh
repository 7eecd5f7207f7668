#!/usr/bin/env bash
# The GPU measurements RESULTS.md reports, as parts of one background job on the staged machine
# (after stage.sh 1 and 2, from the copy of the tree that stage.sh 2 made in /tmp/tree: each device
# call replaces the working tree it ran in). Parts, in order of value: demo (`outrider demo` from a bare start,
# ~20 min), trees (chains against EAGLE-2 trees on the demo's head), bench (the demo's head at k = 5 as typed and with --no-compile), batches (planner vs
# engine at batch 1/4/16/64), cache (cache_bench), mla (mla_check), stream (stream_bench), shape
# (shape_change); not in the default chain: gputests (tests/test_gpu.py's graph tests), compare
# (drafters_compare.sh: EAGLE-3, P-EAGLE, DFlash at CMP_STEPS steps on the demo's data, and trees),
# treeplan (the planner's tree prices against compare's trees), walk (walk_check on compare's
# EAGLE-3 head: eval-split against held-out prompts; split_check on its data), demowalk (the same on
# the demo's head and data), regen (regen_rate: the data stage's replies per second, where a wave's time goes, a profile),
# treeround (tree_round.py: a random head's chain and tree rounds), draftround (drafter_round.py: EAGLE-3,
# P-EAGLE and DFlash drafting per round, eager and compiled), demotrees (the demo's head: chain and two trees
# in one process). Each part writes its results into $RES and a `PART.done` marker before the next
# starts; a part already done is skipped, so `start` again on the same machine resumes the chain.
#   gpu_run.sh start [PART ...]   launch the job (default: every part) and return
#   gpu_run.sh wait S             wait up to S seconds (a device call lasts 10 minutes at most and an
#                                 idle machine is taken back after 30 s: chain the calls), then pack
#                                 everything done so far into $OUT/results.tgz
set -u
RES=/tmp/res
BIG=/tmp/res-big  # files too large for results.tgz, sent in parts
DEMO=/tmp/demo
CMP=/tmp/cmp
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
ALL="demo trees bench batches cache mla stream shape"

stage() {  # stage NAME COMMAND...: timed, logged, never stops the job
  local name=$1; shift
  echo "$(date +%T) start $name" >> $RES/status
  local t0=$(date +%s)
  "$@" > $RES/$name.log 2>&1
  local rc=$?
  echo "$(date +%T) end $name rc $rc $(( $(date +%s) - t0 )) s" >> $RES/status
}

part_smoke() {  # not in the default chain: a minute that shows the staged machine benches at all
  stage smoke outrider bench default --method ngram --k 3 --num-prompts 2 --max-new-tokens 16 --json $RES/smoke.json
}
part_demo() {
  stage demo outrider demo --out $DEMO ${DEMO_PRESET:+--preset $DEMO_PRESET}  # DEMO_PRESET: default full
  cp $DEMO/summary.md $DEMO/bench.json $RES/ 2>/dev/null
  xz -c $DEMO/train/metrics.jsonl > $RES/demo-train-metrics.jsonl.xz 2>/dev/null
  cp $DEMO/data/manifest.json $RES/demo-data-manifest.json 2>/dev/null
  # the head and the eval split come back too, beside results.tgz in parts of 15 MiB (a file back from
  # the device holds 16 MiB at most), so that walk_check can rerun on a CPU
  tar -C $DEMO -czf $BIG/demo-head-eval.tgz -h head data/manifest.json $(cd $DEMO && ls data/eval-*.parquet) 2>/dev/null
}
part_trees() {  # the demo's head at batch 1: chains k = 3..7 and EAGLE-2 trees of 8 and 16 verified tokens, one run each
  for k in 3 5 7; do
    stage chain-k$k outrider bench default --method eagle3 --draft $DEMO/head --k $k --num-prompts 30 \
        --json $RES/trees-chain-k$k.json
  done
  for t in 2,3,8 4,2,8 4,3,16 4,4,16; do
    stage tree-${t//,/-} outrider bench default --method eagle3 --draft $DEMO/head --tree $t --num-prompts 30 \
        --json $RES/trees-tree-${t//,/-}.json
  done
  stage tree-plan outrider plan default --hardware h200 --calibrate $RES/trees-chain-k5.json \
      --acceptance $RES/trees-tree-4-4-16.json --json $RES/trees-plan.json
}
part_demotrees() {  # the demo's head in one process: the chain of k = 5 and trees (4,3,16), (4,4,16) at batch 1
  stage demotrees python3 benchmarks/drafters_bench.py --out $RES/demotrees --num-prompts 30 --max-new-tokens 128 \
      --run eagle3:$DEMO/head:k=5 --run eagle3:$DEMO/head:tree=4,3,16 --run eagle3:$DEMO/head:tree=4,4,16
}
part_bench() {
  stage typed outrider bench default --method eagle3 --draft $DEMO/head --k 5 --num-prompts 30 \
      --json $RES/bench-typed.json
  stage eager outrider bench default --method eagle3 --draft $DEMO/head --k 5 --num-prompts 30 --no-compile \
      --json $RES/bench-eager.json
}
part_batches() {
  stage batches python3 benchmarks/planner_batches.py --out $RES --draft $DEMO/head --k 5 \
      --batches 1,4,16,64 --num-prompts 32 --max-new-tokens 128 --device cuda
}
part_cache() {
  stage cache python3 benchmarks/cache_bench.py --data $DEMO/data --work /tmp/cb --steps 100 --examples 3000 \
      --json $RES/cache_bench.json
  rm -rf /tmp/cb
}
part_mla() {
  stage mla python3 benchmarks/mla_check.py --out $RES --targets default,tiny-dsv3 --steps 120 \
      --conversations 1000 --regenerate --k 5
}
part_stream() {
  stage stream python3 benchmarks/stream_bench.py --out /tmp/sb/ckpt --gpu-memory 60 --tokens-per-pass 131072 \
      --passes 1 --layers 2 --json $RES/stream_bench.json
  rm -rf /tmp/sb
}
part_gputests() {  # the CUDA fast path against plain generate (graphs of chains, P-EAGLE, DFlash, trees)
  stage gputests python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider -k "graphs_equal or prompt"
}
part_compare() {  # EAGLE-3, P-EAGLE, DFlash at CMP_STEPS optimizer steps each on the demo's data; EAGLE-2 trees
  # (CMP_TREES, empty for none); drafters_compare.sh's METHODS, BATCHES and DFLASH_* pass through
  STEPS=${CMP_STEPS:-800} TREES=${CMP_TREES-4,3,16 4,4,16} stage compare bash benchmarks/drafters_compare.sh $CMP 5
  collect_compare
}
collect_compare() {  # what the compare has written so far, into $RES (`wait` calls it too, for a compare cut short)
  cp $CMP/table.md $CMP/env.txt $CMP/bench-*.json $CMP/bench.log $RES/ 2>/dev/null
  for m in eagle3 parallel dflash; do
    [ -f $CMP/$m/metrics.jsonl ] && xz -c $CMP/$m/metrics.jsonl > $RES/train-$m-metrics.jsonl.xz
  done
  cp $CMP/train-*.log $RES/ 2>/dev/null
  cp $CMP/demo/data/manifest.json $RES/demo-data-manifest.json 2>/dev/null
}
part_treeplan() {  # the planner's tree prices from the chain's measured costs, against the measured trees
  for t in 4-3-16 4-4-16; do
    stage plan-$t outrider plan default --hardware h100 --calibrate $CMP/bench-eagle3-b1-k5.json \
        --acceptance $CMP/bench-eagle3-b1-tree-$t.json --json $RES/plan-tree-$t.json
  done
}
walk_on() {  # walk_on DATA HEAD TAG: the trainer's walked tau against the engine's, eval-split and held-out prompts
  stage split$3 python3 benchmarks/split_check.py --data $1 --out $RES/split$3.json
  stage walk-eval$3 python3 benchmarks/walk_check.py --head $2 --data $1 --examples 30 \
      --k 5 --device cuda --out $RES/walk-eval$3.json
  stage walk-heldout$3 python3 benchmarks/walk_check.py --head $2 --prompts sharegpt --examples 30 \
      --k 5 --device cuda --out $RES/walk-heldout$3.json
  for t in first later; do  # the eval split's first exchanges (as the bench's prompts are) against its later turns
    stage walk-eval-$t$3 python3 benchmarks/walk_check.py --head $2 --data $1 --texts $t --examples 30 \
        --k 5 --device cuda --out $RES/walk-eval-$t$3.json
  done
}
part_walk() { walk_on $CMP/demo/data $CMP/eagle3/head ""; }  # compare's EAGLE-3 head
part_demowalk() { walk_on $DEMO/data $DEMO/head -demo; }  # the demo's head
part_regen() {  # the data stage's regeneration rate by batch size
  stage regen python3 benchmarks/regen_rate.py --batches 128,256 --prompts 2048 --out $RES/regen_rate.json \
      --profile $RES/regen-profile.txt
}
part_treeround() {  # a random head's chain and tree rounds at this commit (bf16 compiled; float32 against plain greedy)
  stage treeround python3 benchmarks/tree_round.py --device cuda --dtype bfloat16 --graphs --compile --num-prompts 4 \
      --max-new-tokens 128 --json $RES/tree-round.json
  stage treeround-fp32 python3 benchmarks/tree_round.py --device cuda --dtype float32 --graphs --num-prompts 4 \
      --max-new-tokens 48 --repeats 1 --trees '1,3,4;4,3,16' --json $RES/tree-round-fp32.json
}
part_draftround() {  # drafting per round (random drafters, default target, bf16, graphs): EAGLE-3, P-EAGLE, DFlash at
  # k = 3 and 5, batch 1 and 8, the target and drafters eager, then compiled
  stage draftround python3 benchmarks/drafter_round.py --device cuda --dtype bfloat16 --graphs \
      --methods eagle3,parallel,dflash --ks 3,5 --json $RES/drafter-round-eager.json
  stage draftround-compiled python3 benchmarks/drafter_round.py --device cuda --dtype bfloat16 --graphs --compile \
      --methods eagle3,parallel,dflash --ks 3,5 --json $RES/drafter-round-compiled.json
}
part_shape() {
  stage shape python3 benchmarks/shape_change.py --json $RES/shape_change.json
}

job() {
  for p in "$@"; do
    [ -f $RES/$p.done ] && continue
    part_$p
    touch $RES/$p.done
  done
  echo "$(date +%T) DONE" >> $RES/status
}

case "${1:-}" in
start) shift  # a machine may keep /tmp from an earlier lease: another commit's results and outputs go first
       [ -f $RES/commit ] && [ "$(cat $RES/commit)" != "${COMMIT:-unknown}" ] && rm -rf $RES $BIG $DEMO $CMP
       mkdir -p $RES $BIG; sed -i '/DONE/d' $RES/status 2>/dev/null
       nvidia-smi --query-gpu=name,memory.total --format=csv > $RES/gpu.txt
       echo "${COMMIT:-unknown}" > $RES/commit  # the device copy has no .git: the caller names it
       setsid nohup bash "$0" job ${@:-$ALL} > $RES/job.log 2>&1 < /dev/null & sleep 2; cat $RES/status;;
job) shift; job "$@";;
wait) end=$(( $(date +%s) + $2 ))
      while [ "$(date +%s)" -lt "$end" ] && ! grep -q DONE $RES/status; do sleep 10; done
      cat $RES/status; tail -n 3 $RES/*.log | tail -40
      [ -f $RES/demo.done ] || cp $DEMO/bench.json $RES/demo-bench-so-far.json 2>/dev/null  # a cut demo's records
      grep -q 'start compare' $RES/status && [ ! -f $RES/compare.done ] && collect_compare  # a cut compare's files
      tar czf $OUT/results.tgz -C $RES .
      for f in $BIG/*.tgz; do [ -f "$f" ] && split -b 15m -d "$f" $OUT/$(basename $f).; done ;;
*) echo "usage: gpu_run.sh start [PART ...] | wait SECONDS   (parts: $ALL)"; exit 2;;
esac
