"""`benchmarks/trainer_gpu.py` still runs on CPU at a tiny size (`--small`), one table row per
(loss, activation checkpointing) mode; no speed or memory claim here (the GPU run makes those)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_trainer_gpu_prints_a_row_per_mode():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "trainer_gpu.py"), "--small", "--device", "cpu",
           "--steps", "1", "--seq-len", "64", "--loss", "chunked,full", "--ac", "every_layer",
           "--loss-chunk-tokens", "16"]  # AC off is the trainer tests' (tests/train/test_activation_checkpointing.py)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line.split("|")[1:3] for line in res.stdout.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    modes = [(loss.strip(), ac.strip()) for loss, ac in rows]
    assert modes == [("chunked", "every_layer"), ("full", "every_layer")], res.stdout


def test_profile_prints_the_last_steps_ops_by_device_time():
    """`--profile`: PyTorch's profiler around the last step only, its table printed before that
    step's line (on CPU sorted by CPU time); the matmuls of the step are in it. The rows are
    right-padded (`--pad-fraction`), as the padded-step measurement runs them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "trainer_gpu.py"), "--small", "--device", "cpu",
           "--steps", "2", "--seq-len", "64", "--profile", "--pad-fraction", "0.25"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    table = [i for i, line in enumerate(lines) if "Self CPU time total" in line]
    steps = [i for i, line in enumerate(lines) if line.startswith("step ")]
    assert len(table) == 1 and len(steps) == 2 and steps[0] < table[0] < steps[1], res.stdout[-3000:]
    assert any(line.lstrip().startswith(("aten::mm", "aten::addmm")) for line in lines[:table[0]]), res.stdout[-3000:]
