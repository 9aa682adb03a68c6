#!/usr/bin/env bash
# Install the project with every extra into the current Python, for a CI job or by hand.
# torch is never pulled in by the resolver: a GPU runner's image brings its CUDA build;
# `ci/install.sh --cpu-torch` installs the CPU build from PyTorch's CPU index first, by
# exact version (the README's quick start does the same in a venv). nox sessions run from
# this Python take its torch (noxfile.py: share_torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
    if [ "${1:-}" != "--cpu-torch" ]; then
        echo "ci/install.sh: torch is not installed; install the build that fits this runner" \
             "(or pass --cpu-torch for the CPU build)" >&2
        exit 1
    fi
    python -m pip install --disable-pip-version-check torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
python -m pip install --disable-pip-version-check -e ".[test,gpu,bench,dev]"
