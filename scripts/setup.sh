#!/usr/bin/env bash
# Create .venv (once) and install pipesim with its test tools into it.
# torch is pinned first so that the project's looser `torch>=2.4` is already met and pip
# does not pull a multi-GB CUDA build on a CPU machine; set PIPESIM_TORCH to change it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${PIPESIM_TORCH:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.pipesim-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
        || [ -n "$(find schedules -name '*.c' -newer "$stamp")" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install --quiet "$TORCH_SPEC"
    .venv/bin/python -m pip install --quiet -e ".[test]"
    touch "$stamp"
fi
