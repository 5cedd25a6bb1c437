#!/usr/bin/env bash
# Set up, then simulate gpipe, 1f1b and interleaved-1f1b and write Gantt charts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pipesim demo "$@"
