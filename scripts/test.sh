#!/usr/bin/env bash
# Install outrider with its test dependencies, fetch the embedded default model, run the tests.
# The peers' model classes (SpecForge, speculators) are installed without their dependencies:
# their full installs pin CUDA builds of torch; our tests need only their pure-Python modules.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install torch==2.13.0
pip install -e '.[test]'
pip install --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
outrider pull
python -m pytest -q
