#!/usr/bin/env bash
# Staging the default model and data on a GPU machine with no network (the lent H200), in two
# calls that each carry under 64 MiB with the tree: the GGUF is xz-compressed and cut in two parts,
# ShareGPT is xz-compressed.
# Prepared here by `bash dev/device/prepare.sh` (git-ignored .dev/ and .whl/).
#   call 1: bash dev/device/stage.sh 1     (carry .dev/stage1)
#   call 2: bash dev/device/stage.sh 2     (carry .dev/stage2 .whl), within 30 s of call 1
# Call 2 copies the tree to /tmp/tree (the next device call removes the one it ran in) and installs
# outrider from there: run gpu_run.sh from /tmp/tree. After call 2 the machine holds what
# `outrider pull` holds on a networked machine, pulled by `outrider pull --from /tmp/src`, and the
# `outrider` command.
set -euo pipefail
mkdir -p /tmp/src
case "$1" in
1) cp .dev/stage1/g.xz.00 /tmp/src/
   nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)";;
2) [ -f /tmp/src/g.xz.00 ] || { echo "no part 1: the machine was released; run call 1 again"; exit 3; }
   cat /tmp/src/g.xz.00 .dev/stage2/g.xz.01 | xz -dc > /tmp/src/SmolLM2-135M-Instruct.Q4_1.gguf
   rm /tmp/src/g.xz.00
   xz -dc .dev/stage2/sharegpt.json.xz > /tmp/src/ShareGPT_V3_unfiltered_cleaned_split.json
   rm -rf /tmp/tree; mkdir -p /tmp/tree; cp -a . /tmp/tree; cd /tmp/tree
   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
   python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
   export PYTHONPATH=/tmp/site
   outrider pull --from /tmp/src --quiet;;
*) echo "usage: stage.sh 1|2"; exit 2;;
esac
