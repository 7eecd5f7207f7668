#!/usr/bin/env bash
# Refresh constraints.txt: resolve today's releases within pyproject.toml's ranges in a fresh
# virtual environment (no constraints), run the suite there, and write what it ran against
# only if it passed. Review the diff of constraints.txt, then commit it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-/tmp/outrider-refresh}
python3 -m venv --clear "$venv"
. "$venv/bin/activate"
pip install torch==2.13.0
pip install -e '.[test]'
pip install --no-deps specforge speculators hs-connectors
outrider pull
python -m pytest -q
{
  echo "# The versions the test suite last passed against (Python 3.11, CPU); written by dev/refresh-constraints.sh."
  pip freeze --exclude-editable | sed 's/+cpu$//'
} > constraints.txt
echo "constraints.txt refreshed: review 'git diff constraints.txt' and commit it"
