#!/usr/bin/env bash
# Print how many CUDA GPUs this process sees (honours CUDA_VISIBLE_DEVICES); exit 1 if none.
set -euo pipefail
count=$(kvharness detect --json | python -c "import json, sys; print(json.load(sys.stdin)['gpu_count'])")
if [ "$count" -lt 1 ]; then
    echo "no CUDA GPU visible here: use ci/cpu.sh on CPU-only machines" >&2
    exit 1
fi
echo "$count"
