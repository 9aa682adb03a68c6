#!/usr/bin/env bash
# `ci/conform.sh ENGINE==VERSION`: `kvharness conform` over one release, 8 fuzz seeds; its
# report (report.json, report.md, a replay file per finding, the worker's log) lands in
# results/conform/ENGINE-VERSION/. Exit 0 when the run judged the release, findings or
# not: a finding is the matrix's data, not the job's failure; exit 2 when it could not
# run (the report says why, and the matrix shows it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [[ "$1" != *==* ]]; then
    echo "usage: ci/conform.sh ENGINE==VERSION" >&2
    exit 2
fi
code=0
python -m harness.cli conform "$1" --seeds 8 || code=$?
if [ "$code" -eq 1 ]; then
    code=0
fi
exit "$code"
