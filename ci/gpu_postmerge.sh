#!/usr/bin/env bash
# Post-merge shard on a GPU runner: `ci/gpu_postmerge.sh SHARD SHARDS [pytest args...]`
# runs shard SHARD (1-based) of SHARDS of the post_merge blocks for this GPU, assigned
# by pytest-split's least_duration over the committed durations
# (test_lists/.test_durations), one pytest-xdist worker per GPU inside the runner. Each
# shard writes shard.json (predicted and actual time) into results/postmerge/.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
    echo "usage: ci/gpu_postmerge.sh SHARD SHARDS [pytest args...]" >&2
    exit 2
fi
shard=$1
shards=$2
shift 2
gpus=$(ci/gpus.sh)
exec nox -s postmerge -- -n "$gpus" --kvh-gpu-per-worker --kvh-shard "$shard" --kvh-shards "$shards" "$@"
