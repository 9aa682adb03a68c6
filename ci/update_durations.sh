#!/usr/bin/env bash
# Refresh test_lists/.test_durations, which pytest-split shards post-merge runs by: run
# both stages' lists on this machine storing durations (merged into the file, so run it
# on a CPU machine and on each GPU kind), then commit the file.
set -euo pipefail
cd "$(dirname "$0")/.."
durations=(--store-durations --durations-path test_lists/.test_durations)
nox -s premerge -- "${durations[@]}" "$@"
nox -s postmerge -- "${durations[@]}" "$@"
