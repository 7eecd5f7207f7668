#!/usr/bin/env bash
# Issue 51's GPU rows: the layer-streamed capture of a Kimi-K2.5-wide checkpoint (1 dense + 2 MoE
# layers, INT4 experts, ~25 GB) under --gpu-memory 60 on one 80 GB card, sized by the memory plan.
#
#   bash benchmarks/gpu_issue51.sh OUT_DIR        (from the repository root; no network needed)
#
# Run 1 prices SDPA at its math path (the default, an upper bound); run 2 at CUDA's fused kernels
# (larger chunks). Each writes its log and JSON record under OUT_DIR; the checkpoint goes to
# $SCRATCH (default /tmp/outrider-issue51), kept between the runs and removed by the last.
# The exit status is the first failing run's (2: the plan refused the budget). STREAM_BENCH_ARGS is
# appended to every run (the last value of a flag wins): e.g. a CPU dry run with
# STREAM_BENCH_ARGS="--shape tiny --device cpu --tokens-per-pass 600 --lo 16 --hi 48".
set -uo pipefail

out=${1:?usage: bash benchmarks/gpu_issue51.sh OUT_DIR}
scratch=${SCRATCH:-/tmp/outrider-issue51}
mkdir -p "$out" "$scratch"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  python -c 'from outrider.provenance import git_commit; print(git_commit() or "no git")'  # -dirty: not the commit's tree
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} > "$out/env.txt" 2>&1

status=0
run() {  # run NAME ARGS...: one stream_bench invocation, its log and record under $out
  local name=$1
  shift
  echo "== $name: python benchmarks/stream_bench.py $*" | tee "$out/$name.log"
  python benchmarks/stream_bench.py --out "$scratch/ckpt" --gpu-memory 60 --tokens-per-pass 131072 \
    --layers 2 --passes 2 --default-model none --json "$out/$name.json" "$@" ${STREAM_BENCH_ARGS:-} 2>&1 \
    | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc" | tee -a "$out/status"
  if [ "$status" -eq 0 ] && [ "$rc" -ne 0 ]; then status=$rc; fi
}

run stream-math --attention-memory math --keep
run stream-fused --attention-memory fused
rm -rf "$scratch"
exit "$status"
