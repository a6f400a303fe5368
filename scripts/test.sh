#!/usr/bin/env bash
# The test command: set up ./.venv, then run the whole suite (CPU, gloo, Triton interpreter); the
# 40 slowest tests are listed at the end, to keep the suite short.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q --durations=40 "$@"
