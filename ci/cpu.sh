#!/usr/bin/env bash
# CPU job: `ci/cpu.sh [premerge|postmerge] [pytest args...]` runs that nox session (default
# premerge, the README's test command) on the l0_cpu lists. Results in results/<session>/.
set -euo pipefail
cd "$(dirname "$0")/.."
session=premerge
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
    session=$1
    shift
fi
case "$session" in
    premerge | postmerge) ;;
    *) echo "ci/cpu.sh: unknown session '$session' (premerge or postmerge)" >&2; exit 2 ;;
esac
exec nox -s "$session" -- "$@"
