#!/usr/bin/env bash
# GPU check on a GPU runner or by hand: `ci/gpu_check.sh [--budget S] [--stages A,B] ...`
# runs `nox -s gpu` (`python -m harness.gpu_check` where nox is absent), then appends
# results/gpu/report.md to the GitHub job summary when $GITHUB_STEP_SUMMARY is set.
# Without CUDA it prints one line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
if command -v nox >/dev/null 2>&1; then
    nox -s gpu -- "$@" || status=$?
else
    python -m harness.gpu_check "$@" || status=$?
fi
if [ -n "${GITHUB_STEP_SUMMARY:-}" ] && [ -f results/gpu/report.md ]; then
    cat results/gpu/report.md >> "$GITHUB_STEP_SUMMARY"
fi
exit "$status"
