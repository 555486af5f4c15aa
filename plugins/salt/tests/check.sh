#!/bin/bash
# Lint and unit tests of the Salt extension (plugins/salt): ruff, then every unittest under
# plugins/salt/tests with Salt 3007 from target/salt-venv (made by tests/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=../../target/salt-venv/bin
if [ ! -x "$venv/python" ] || [ ! -x "$venv/ruff" ]; then
    echo "check.sh: $venv/python or ruff missing: run tests/setup.sh first" >&2
    exit 1
fi
"$venv/ruff" check .
"$venv/ruff" format --check .
# -W ignore::ImportWarning: Salt's own import hooks warn under Python 3.11; not ours.
"$venv/python" -W ignore::ImportWarning -m unittest discover -s tests -t tests
