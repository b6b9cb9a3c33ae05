#!/usr/bin/env bash
# Run the multi-rank tests (marker `ranks`) N times in a row, default 5, and print each run's summary line; stop
# at the first failing run (its log is kept). A test that fails once in N runs is a bug to find, not noise.
#   tests/repeat_ranks.sh [N] [pytest options...]     e.g. tests/repeat_ranks.sh 5 -m "ranks and not slow"
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
shift $(( $# > 0 ? 1 : 0 ))
log=$(mktemp -t repeat_ranks.XXXXXX)
for run in $(seq 1 "$runs"); do
  start=$(date +%s)
  python -m pytest -m ranks -q -p no:cacheprovider "$@" > "$log" 2>&1
  status=$?
  echo "run $run of $runs: $(tail -n 1 "$log") [$(( $(date +%s) - start )) s]"
  if [ "$status" -ne 0 ]; then
    echo "failed: the whole log is $log" >&2
    exit "$status"
  fi
done
rm -f "$log"
