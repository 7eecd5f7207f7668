#!/usr/bin/env bash
# The GPU measurements RESULTS.md reports, in one background job on the staged machine
# (after stage.sh 1 and 2): `gpu_run.sh start` launches it and returns; `gpu_run.sh wait S`
# waits up to S seconds (a device call lasts 10 minutes at most, and an idle machine is taken back
# after 30 s: chain the calls), then packs what is done into $OUT/results.tgz.
set -u
RES=/tmp/res
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
stage() {  # stage NAME COMMAND...: timed, logged, never stops the job
  local name=$1; shift
  echo "$(date +%T) start $name" >> $RES/status
  local t0=$(date +%s)
  "$@" > $RES/$name.log 2>&1
  echo "$(date +%T) end $name rc $? $(( $(date +%s) - t0 )) s" >> $RES/status
}
job() {
  stage stream python3 benchmarks/stream_bench.py --out /tmp/sb/ckpt --gpu-memory 80 --tokens-per-pass 131072 \
      --passes 1 --layers 2 --json $RES/stream_bench.json
  rm -rf /tmp/sb
  stage demo outrider demo --out /tmp/demo
  cp /tmp/demo/summary.md /tmp/demo/bench.json $RES/ 2>/dev/null
  cp /tmp/demo/train/metrics.jsonl $RES/demo-train-metrics.jsonl 2>/dev/null
  cp /tmp/demo/data/manifest.json $RES/demo-data-manifest.json 2>/dev/null
  stage typed outrider bench default --method eagle3 --draft /tmp/demo/head --k 5 --num-prompts 30 \
      --json $RES/bench-typed.json
  stage eager outrider bench default --method eagle3 --draft /tmp/demo/head --k 5 --num-prompts 30 --no-compile \
      --json $RES/bench-eager.json
  stage batches python3 benchmarks/planner_batches.py --out $RES --draft /tmp/demo/head --k 5 \
      --batches 1,4,16,64 --num-prompts 32 --max-new-tokens 128 --device cuda
  stage cache python3 benchmarks/cache_bench.py --data /tmp/demo/data --work /tmp/cb --steps 100 --examples 3000 \
      --json $RES/cache_bench.json
  rm -rf /tmp/cb
  stage mla python3 benchmarks/mla_check.py --out $RES --targets default,tiny-dsv3 --steps 120 \
      --conversations 2000 --regenerate --k 5
  stage shape python3 benchmarks/shape_change.py --json $RES/shape_change.json
  echo "$(date +%T) DONE" >> $RES/status
}
case "$1" in
start) mkdir -p $RES; nvidia-smi --query-gpu=name,memory.total --format=csv > $RES/gpu.txt
       setsid nohup bash "$0" job > $RES/job.log 2>&1 < /dev/null & sleep 2; cat $RES/status;;
job) job;;
wait) end=$(( $(date +%s) + $2 ))
      while [ "$(date +%s)" -lt "$end" ] && ! grep -q DONE $RES/status; do sleep 10; done
      cat $RES/status; tail -n 3 $RES/*.log | tail -40
      tar czf $OUT/results.tgz -C $RES . ;;
esac
