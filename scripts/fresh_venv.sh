#!/usr/bin/env bash
# Make a fresh virtual environment and install the package into it, as a new user would.
#
#   scripts/fresh_venv.sh DIR [PIP_INSTALL_ARGS...]
#
# DIR is removed first if it exists. Without PIP_INSTALL_ARGS it runs the README's test install,
# `pip install torch==2.13.0 -e ".[test]"`, from the repository root, so pip resolves today's versions of everything
# else. PYTHON picks the interpreter (default: python3). Then, for example:
#   DIR/bin/python -m pytest -q
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
venv=$1
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
python=${PYTHON:-python3}

rm -rf "$venv"
"$python" -m venv "$venv"
cd "$root"
if [[ $# -eq 0 ]]; then
  set -- torch==2.13.0 -e ".[test]"
fi
echo "fresh_venv: $("$venv/bin/python" --version) in $venv: pip install $*"
"$venv/bin/python" -m pip install -q "$@"
"$venv/bin/python" - <<'PY'
from importlib.metadata import PackageNotFoundError, version

names = ["torch", "lightning", "torchmetrics", "typing-extensions", "numpy", "pytest", "transformers", "jsonargparse"]
found = []
for name in names:
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        pass
print("fresh_venv: installed " + ", ".join(found))
PY
