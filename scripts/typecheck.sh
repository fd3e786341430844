#!/usr/bin/env bash
# The type check of CI: mypy, at a bounded version, on the package and on a user's snippet
# (tests/typecheck/snippet.py), with the configuration of pyproject.toml.
#
#   scripts/typecheck.sh [VENV]     (default: the python on PATH, or $PYTHON)
#
# The snippet builds every public class with keyword options, and ends with a misspelt keyword and a wrong value,
# each under a `type: ignore`. --warn-unused-ignores makes an ignore that the checker did not need an error, so the
# check fails when mypy stops reporting those two calls (when it no longer sees the options as keywords).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[[ -z ${1:-} ]] || python=$1/bin/python
# Bounded: a new mypy release brings new errors; raise the bound deliberately, with the fixes it asks for.
mypy_version='mypy>=2.4,<2.5'

"$python" -m pip install -q "$mypy_version"
"$python" -m mypy --version
"$python" -m mypy --warn-unused-ignores lightning_cudagraph tests/typecheck/snippet.py
