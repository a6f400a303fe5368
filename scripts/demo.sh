#!/usr/bin/env bash
# The demo command: set up ./.venv, then run AllGather CP=4 on a tiny Qwen3 with 4 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc-per-node 4 examples/demo_all_gather.py "$@"
