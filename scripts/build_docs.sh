#!/usr/bin/env bash
# Build the documentation site with warnings as errors (`mkdocs build --strict`) into site/ (or SITE_DIR).
#
#   scripts/build_docs.sh [SITE_DIR]
#
# It installs nothing: install the docs tools first, `pip install -e ".[docs]"` (torch is not needed; the API
# reference is read from the source). Open SITE_DIR/index.html (default: site/index.html) to read the site.
# MKDOCS picks the mkdocs command (default: `python -m mkdocs`, with PYTHON defaulting to python3).
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
python=${PYTHON:-python3}
cd "$root"
site=${1:-$root/site}
export NO_MKDOCS_2_WARNING=1  # Material's banner about its successor, printed on every build
if [[ -n ${MKDOCS:-} ]]; then
  mkdocs=("$MKDOCS")
elif "$python" -c "import mkdocs, mkdocstrings, material" 2>/dev/null; then
  mkdocs=("$python" -m mkdocs)
else
  echo "build_docs: the docs tools are not installed for $python; run: pip install -e \".[docs]\"" >&2
  exit 1
fi
"${mkdocs[@]}" build --strict --site-dir "$site"
# Sphinx roles in docstrings must reach the API page as code, not as raw text (docs/griffe_sections.py).
roles=':(class|mod|meth|func|attr|data|exc|obj):(`|<code>)'
raw=$({ grep -roE "$roles" "$site" --include='*.html' || true; } | wc -l)
if [[ $raw -ne 0 ]]; then
  echo "build_docs: $raw raw Sphinx role(s) in the built pages:" >&2
  grep -roE ".{0,40}$roles.{0,40}" "$site" --include='*.html' | head -5 >&2
  exit 1
fi
echo "build_docs: built $(find "$site" -name '*.html' | wc -l) pages into $site"
