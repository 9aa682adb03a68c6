#!/usr/bin/env bash
# Post-merge shard on a GPU runner: `ci/gpu_postmerge.sh GROUP SPLITS [pytest args...]`
# runs shard GROUP (1-based) of SPLITS of the post_merge blocks for this GPU, split by the
# committed durations (pytest-split), one pytest-xdist worker per GPU inside the runner.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
    echo "usage: ci/gpu_postmerge.sh GROUP SPLITS [pytest args...]" >&2
    exit 2
fi
group=$1
splits=$2
shift 2
gpus=$(ci/gpus.sh)
exec nox -s postmerge -- -n "$gpus" --gpu-per-worker \
    --splits "$splits" --group "$group" --durations-path test_lists/.test_durations "$@"
