# Sourced by every device script: the machine's Python sees the carried wheels, this checkout and
# benchmarks/, the default model under /tmp/oh, and the commit staged by device_prep.py.
if [ -d .whl ] && [ ! -d /tmp/site/gguf ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:.:benchmarks OUTRIDER_HOME=/tmp/oh
export OUTRIDER_COMMIT=$(cat .dev/commit 2>/dev/null || echo unknown)
mkdir -p /tmp/src /tmp/run
DEV=${DEV:-cuda}  # DEV=cpu: a dry run of the scripts on a machine without a GPU (float32, slow)
