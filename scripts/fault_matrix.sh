#!/usr/bin/env bash
# Issue 31's fault matrix across nodes: every fault x {static, elastic} x {quiet, two busy CPUs} x
# {NumPy, none}, two launchers on 127.0.0.1 per cell (tests/matrix/), and the other tests marked
# 'matrix' (too heavy for the README's suite). CI runs it after the suite. The quiet half runs
# first; then two CPU hogs (started here, ended here by PID) run beside the loaded half.
# Extra arguments go to pytest, e.g. scripts/fault_matrix.sh -x.
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
run() { "$py" -m pytest tests -m matrix -p no:cacheprovider -q --durations=12 "$@"; }
# The quiet half: three at once (its cells wait on their steps and rendezvous as much as they compute);
# the loaded half: two at once, beside the two hogs.
run -n 3 -k "not load" "$@"; quiet=$?
hogs=()
for _ in 1 2; do "$py" -c "while True: pass" & hogs+=($!); done
MULTIGPU_MATRIX_HOGS=outside run -n 2 -k load "$@"; loaded=$?
kill "${hogs[@]}"; wait "${hogs[@]}" 2>/dev/null
echo "fault matrix: quiet half exit $quiet, loaded half exit $loaded"
[ "$quiet" = 0 ] && [ "$loaded" = 0 ]
