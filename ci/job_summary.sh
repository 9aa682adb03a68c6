#!/usr/bin/env bash
# `ci/job_summary.sh [RESULTS_DIR]`: the markdown summary of a results folder (junit,
# reuse report, benchmark JSON; default results/), appended to the GitHub job summary
# when $GITHUB_STEP_SUMMARY is set, printed otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-results}
if [ ! -d "$results" ]; then
    echo "ci/job_summary.sh: no results folder '$results' (did the run start?)" >&2
    exit 0
fi
if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then
    kvharness report --results-dir "$results" >> "$GITHUB_STEP_SUMMARY"
else
    kvharness report --results-dir "$results"
fi
