#!/usr/bin/env bash
# `ci/conform_releases.sh`: every release with a lock in harness/conform/locks/, as the
# conform workflow's job matrix: one line `releases=[{"spec": "vllm==0.33.0", "name":
# "vllm-0.33.0"}, ...]`, appended to $GITHUB_OUTPUT when it is set, printed always.
set -euo pipefail
cd "$(dirname "$0")/.."
line=$(python - <<'PY'
import json

from harness.conform.controller.locks import supported

releases = [{"spec": f"{engine}=={version}", "name": f"{engine}-{version}"}
            for engine, versions in sorted(supported().items()) for version in versions]
print("releases=" + json.dumps(releases))
PY
)
if [ -n "${GITHUB_OUTPUT:-}" ]; then
    echo "$line" >> "$GITHUB_OUTPUT"
fi
echo "$line"
