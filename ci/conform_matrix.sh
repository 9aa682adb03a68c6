#!/usr/bin/env bash
# `ci/conform_matrix.sh REPORTS [DOC]`: fold the conform reports under REPORTS
# (ENGINE-VERSION/report.json, however deep) into the version matrix: written into DOC
# between its markers (default docs/conformance.md) and to REPORTS/matrix.md, appended to
# the GitHub job summary when $GITHUB_STEP_SUMMARY is set.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: ci/conform_matrix.sh REPORTS [DOC]" >&2
    exit 2
fi
reports=$1
doc=${2:-docs/conformance.md}
python -m harness.cli report --conform "$reports" --into "$doc" --output "$reports/matrix.md"
if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then
    { echo "# Conformance matrix"; echo; cat "$reports/matrix.md"; } >> "$GITHUB_STEP_SUMMARY"
fi
