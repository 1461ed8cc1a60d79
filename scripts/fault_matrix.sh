#!/usr/bin/env bash
# Issue 31's fault matrix across nodes: every fault x {static, elastic} x {quiet, two busy CPUs} x
# {NumPy, none}, two launchers on 127.0.0.1 per cell (tests/matrix/). Run after the suite in CI.
# Usage: scripts/fault_matrix.sh [pytest args...], e.g. -k load to run the loaded half.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest tests/matrix -m "" -n 2 -p no:cacheprovider "$@"
