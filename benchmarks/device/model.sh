# Call 2 (carry .dev/b2 .dev/b3 .dev/commit), within 30 s of call 1: the default model converted
# under /tmp/oh (kept while the machine stays warm), the exchanges unpacked into /tmp/src.
. benchmarks/device/env.sh
if [ ! -f /tmp/oh/models/SmolLM2-135M-Instruct/config.json ]; then
    [ -f /tmp/src/gguf.part00 ] || { echo "no /tmp/src/gguf.part00: the machine was released, run stage.sh again"; exit 3; }
    cat /tmp/src/gguf.part00 .dev/b2/gguf.part01 > /tmp/src/m.gguf && mkdir -p /tmp/oh/models/SmolLM2-135M-Instruct || exit 1
    python3 -c "from pathlib import Path; from outrider.assets import convert_gguf, default_model_dir; convert_gguf(Path('/tmp/src/m.gguf'), default_model_dir())" || exit 1
fi
for f in .dev/b2/*.json.gz .dev/b3/*.json.gz; do [ -f "$f" ] && gunzip -c "$f" > /tmp/src/$(basename "$f" .gz); done
ls /tmp/src
