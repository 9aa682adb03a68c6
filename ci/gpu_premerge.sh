#!/usr/bin/env bash
# Pre-merge on a GPU runner: the pre_merge blocks for the detected GPU kind and count,
# one pytest-xdist worker per GPU, each pinned to its own GPU. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(ci/gpus.sh)
exec nox -s premerge -- -n "$gpus" --kvh-gpu-per-worker "$@"
