#!/usr/bin/env bash
# Benchmarks: `nox -s bench` (JSON, summary and plots in results/bench/). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec nox -s bench -- "$@"
