#!/usr/bin/env bash
# Set up, then lint and run the whole test suite (multi-process tests use gloo on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
