#!/usr/bin/env bash
# Build the sdist and the wheel as a release would, and check them: no warning from the build, `twine check --strict`
# passing, the wheel holding the package, its py.typed and the licence, the sdist holding no tests.
#
#   scripts/check_dist.sh [OUTDIR]     (default: a temporary folder, removed afterwards)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=${1:-$work/dist}
python=${PYTHON:-python3}

"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q build twine
rm -rf "$out"
# PYTHONDONTWRITEBYTECODE (set on some machines) makes setuptools warn that it skips byte-compiling: that warning
# is the machine's, not the package's, so the build runs without it and any other warning fails the check.
if ! (cd "$root" && env -u PYTHONDONTWRITEBYTECODE "$work/venv/bin/python" -m build --outdir "$out" .) \
  > "$work/build.log" 2>&1; then
  cat "$work/build.log"
  echo "check_dist: the build failed" >&2
  exit 1
fi
# The lines that copy or add a file name it: lightning_cudagraph/_warnings.py is no warning.
if grep -vE "^(copying|adding) " "$work/build.log" | grep -inE "warn|deprecat|no previously-included"; then
  echo "check_dist: the build warned (above)" >&2
  exit 1
fi
"$work/venv/bin/python" -m twine check --strict "$out"/*

"$work/venv/bin/python" - "$out" <<'PY'
import sys
import tarfile
import zipfile
from pathlib import Path

out = Path(sys.argv[1])
(wheel,) = out.glob("*.whl")
(sdist,) = out.glob("*.tar.gz")
wheel_names = zipfile.ZipFile(wheel).namelist()
sdist_names = [name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name]
problems = []
tops = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
if tops != {"lightning_cudagraph"}:
    problems.append(f"the wheel holds {sorted(tops)}, not only lightning_cudagraph/")
for needed in ("lightning_cudagraph/py.typed", "lightning_cudagraph/__init__.py"):
    if needed not in wheel_names:
        problems.append(f"the wheel lacks {needed}")
if not any(name.endswith(".dist-info/licenses/LICENSE") for name in wheel_names):
    problems.append("the wheel lacks its LICENSE")
for needed in ("LICENSE", "PYPI.md", "pyproject.toml", "lightning_cudagraph/py.typed"):
    if needed not in sdist_names:
        problems.append(f"the sdist lacks {needed}")
shipped_tests = [name for name in sdist_names if name.startswith(("tests/", "examples/", "benchmarks/"))]
if shipped_tests:
    problems.append(f"the sdist ships {shipped_tests[:3]}... (tests, examples and benchmarks stay in the repository)")
if problems:
    sys.exit("check_dist: " + "; ".join(problems))
print(f"check_dist: {wheel.name} ({len(wheel_names)} files) and {sdist.name} ({len(sdist_names)} files) are fine")
PY
