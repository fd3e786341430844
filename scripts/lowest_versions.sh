#!/usr/bin/env bash
# Make a fresh virtual environment with the lowest versions that pyproject.toml allows, to test the floors.
#
#   scripts/lowest_versions.sh DIR
#
# The floors are read from pyproject.toml (`name>=X` becomes `name==X`) for the packages in LOWEST_PINNED (default:
# torch lightning torchmetrics transformers jsonargparse pytest); pip resolves the rest of `.[test]` against them.
# The interpreter is the lowest that `requires-python` allows where one can be found (LOWEST_PYTHON overrides it).
# typing-extensions is not pinned in the venv (today's test tools need newer ones); instead the package is imported
# with its floor first on the path. torch on PyPI is a CUDA build for Linux (about 3 GB with its nvidia
# libraries, which a CPU machine imports fine), so that download is kept in a wheelhouse, LCG_WHEELHOUSE (default:
# ~/.cache/lightning-cudagraph/wheels), and made once. Then, for example:
#   DIR/bin/python -m pytest -q
set -euo pipefail

if [[ $# -ne 1 || $1 == -h || $1 == --help ]]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
venv=$1
root="$(cd "$(dirname "$0")/.." && pwd)"
pinned=${LOWEST_PINNED:-torch lightning torchmetrics transformers jsonargparse pytest}
wheelhouse=${LCG_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning-cudagraph/wheels}

# Prints one line per floor, "name==version", for the names given, from every requirement in pyproject.toml.
floors() {
  python3 - "$root/pyproject.toml" "$@" <<'PY'
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

with open(sys.argv[1], "rb") as file:
    project = tomllib.load(file)["project"]
wanted = sys.argv[2:]
requirements = list(project["dependencies"])
for extra in project.get("optional-dependencies", {}).values():
    requirements.extend(extra)
if wanted == ["python"]:
    print(re.fullmatch(r">=\s*([\d.]+)", project["requires-python"]).group(1))
    sys.exit()
found = {}
for requirement in requirements:
    match = re.match(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*(.*)", requirement)
    name, spec = match.group(1).lower(), match.group(3)
    floor = re.search(r">=\s*([^,;\s]+)", spec)
    if name in wanted and floor:
        found[name] = floor.group(1)
missing = sorted(set(wanted) - set(found))
if missing:
    sys.exit(f"lowest_versions: no `>=` floor in pyproject.toml for {missing}")
for name in wanted:
    print(f"{name}=={found[name]}")
PY
}

# The interpreter: LOWEST_PYTHON, else pythonX.Y for the requires-python floor (on PATH or under pyenv), else python3.
find_python() {
  local lowest candidate
  lowest=$(floors python)
  if [[ -n ${LOWEST_PYTHON:-} ]]; then
    echo "$LOWEST_PYTHON"
    return
  fi
  for candidate in "python$lowest" "$(command -v pyenv > /dev/null && pyenv root)/versions/$lowest"*/bin/python; do
    if "$candidate" -c "" > /dev/null 2>&1; then
      command -v "$candidate"
      return
    fi
  done
  echo "lowest_versions: warning: no Python $lowest found (set LOWEST_PYTHON); using python3" >&2
  echo python3
}

pins_text=$(floors $pinned)
mapfile -t pins <<< "$pins_text"
python=$(find_python)
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
echo "lowest_versions: $("$venv/bin/python" --version) in $venv: ${pins[*]} + .[test]"

mkdir -p "$wheelhouse"
torch_pin=$(printf '%s\n' "${pins[@]}" | grep '^torch==' || true)
if [[ -n $torch_pin ]]; then
  # A wheel already in the wheelhouse is not downloaded again; pip then prefers it to the index's copy.
  "${pip[@]}" download -q -d "$wheelhouse" "$torch_pin"
fi
cd "$root"
"${pip[@]}" install -q --find-links "$wheelhouse" "${pins[@]}" -e ".[test]"

# What pip installed must be the floors, not something it preferred.
"$venv/bin/python" - "${pins[@]}" <<'PY'
import sys
from importlib.metadata import version

from packaging.version import Version

wrong = []
for pin in sys.argv[1:]:
    name, wanted = pin.split("==")
    if Version(version(name).split("+")[0]) != Version(wanted):
        wrong.append(f"{name} {version(name)} (wanted {wanted})")
if wrong:
    sys.exit("lowest_versions: not the floors: " + ", ".join(wrong))
print("lowest_versions: installed " + ", ".join(f"{p.split('==')[0]} {version(p.split('==')[0])}" for p in sys.argv[1:]))
PY

# typing-extensions at its floor, first on the path, under the package and its dependencies.
te_pin=$(floors typing-extensions)
te_dir=$(mktemp -d)
trap 'rm -rf "$te_dir"' EXIT
"${pip[@]}" install -q --no-deps --target "$te_dir" "$te_pin"
PYTHONPATH="$te_dir" "$venv/bin/python" -c "
import typing_extensions, lightning_cudagraph
assert typing_extensions.__file__.startswith('$te_dir'), typing_extensions.__file__
print('lowest_versions: lightning_cudagraph imports with $te_pin')
"
