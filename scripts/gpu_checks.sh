#!/usr/bin/env bash
# What we run on a CUDA machine (not CI): the GPU test set, the GDN kernel benchmark and, with
# several GPUs, every CP method over NCCL (equivalence, speed, memory) and the async overlap report.
# Usage: bash scripts/gpu_checks.sh OUT_DIR [benchmark seconds]   (fla-core installed for the comparison)
set -uo pipefail
out=${1:?output folder}
bench_seconds=${2:-380}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
gpus=$(nvidia-smi -L | wc -l)
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gdn/test_gdn_triton_cp.py tests/kernels/test_gdn_triton.py -s \
  2>&1 | tee "$out/gpu_tests.log" | grep -E "vs |passed|failed|Error"
# SIGINT at the limit: the benchmark writes the tables of what it measured so far
timeout -s INT "$bench_seconds" python3 benchmarks/gdn_kernels.py --T 16384 32768 65536 8192 --no-breakdown \
  --out "$out/gdn_kernels.md" 2>&1 | tee "$out/bench.log"
if [ "$gpus" -ge 2 ]; then
  timeout 900 torchrun --standalone --nproc-per-node "$gpus" benchmarks/cp_methods.py --device cuda \
    --out "$out/cp_methods.md" 2>&1 | tee "$out/cp_methods.log" | grep "^|"
  timeout 600 torchrun --standalone --nproc-per-node "$gpus" benchmarks/overlap_report.py --device cuda \
    --methods all_gather ulysses --seq 65536 --dump-dir /tmp/overlap --out "$out/overlap.md" 2>&1 | grep "^|"
fi
