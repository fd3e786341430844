#!/usr/bin/env bash
# Stages Lightning Thunder 0.2.6 (the compiler peer of benchmarks/compile.py) for a GPU machine without a registry.
#
#   bash benchmarks/stage_thunder.sh download      # here, with network: wheels into .whl/thunder (git-excluded)
#   bash benchmarks/stage_thunder.sh install       # there (carry .whl): installs them offline, then imports thunder
#
# Target: Linux x86_64, CPython 3.12, torch (>= 2.7.1) and numpy already installed. The requirements are thunder
# 0.2.6's Requires-Dist less torch and numpy; pip installs each one only where the installed version (if any) does
# not satisfy it, so nothing the image has is replaced. --no-deps: pip never looks at torch's own dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=".whl/thunder"
py="${PYTHON:-python3}"
requirements=(
    "lightning-thunder==0.2.6" "looseversion==1.3.0" "lightning-utilities>0.7.0" "networkx>=3.3"
    "optree>=0.12.1" "opt_einsum>=3.3.0" "mpmath<1.4.0" "dill>=0.3.8"
)
case "${1:-}" in
    download)
        "$py" -m pip download --quiet --dest "$wheels" --no-deps --only-binary=:all: --implementation cp \
            --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 "${requirements[@]}"
        ls -l "$wheels" ;;
    install)
        "$py" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --find-links "$wheels" \
            "${requirements[@]}"
        "$py" -c "import thunder; from thunder.transforms.cudagraph import CUDAGraphTransform; print('thunder', thunder.__version__)" ;;
    *)
        echo "usage: bash benchmarks/stage_thunder.sh download | install" >&2
        exit 2 ;;
esac
