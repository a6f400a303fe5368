"""`benchmarks/trainer_gpu.py` still runs on CPU at a tiny size (`--small`), one table row per
(loss, activation checkpointing) mode; no speed or memory claim here (the GPU run makes those)."""
from __future__ import annotations

from script_ranks import run_script


def test_trainer_gpu_prints_a_row_per_mode():
    stdout = run_script("trainer_gpu.py", "--small", "--device", "cpu", "--steps", "1", "--seq-len", "64",
                        "--loss", "chunked,full", "--ac", "every_layer", "--loss-chunk-tokens", "16",
                        timeout=300)  # AC off is the trainer tests' (tests/train/test_activation_checkpointing.py)
    rows = [line.split("|")[1:3] for line in stdout.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    modes = [(loss.strip(), ac.strip()) for loss, ac in rows]
    assert modes == [("chunked", "every_layer"), ("full", "every_layer")], stdout


def test_profile_prints_the_last_steps_ops_by_device_time():
    """`--profile`: PyTorch's profiler around the last step only, its table printed before that
    step's line (on CPU sorted by CPU time); the matmuls of the step are in it. The rows are
    right-padded (`--pad-fraction`), as the padded-step measurement runs them."""
    stdout = run_script("trainer_gpu.py", "--small", "--device", "cpu", "--steps", "2", "--seq-len", "64", "--profile",
                        "--pad-fraction", "0.25", timeout=300)
    lines = stdout.splitlines()
    table = [i for i, line in enumerate(lines) if "Self CPU time total" in line]
    steps = [i for i, line in enumerate(lines) if line.startswith("step ")]
    assert len(table) == 1 and len(steps) == 2 and steps[0] < table[0] < steps[1], stdout[-3000:]
    assert any(line.lstrip().startswith(("aten::mm", "aten::addmm")) for line in lines[:table[0]]), stdout[-3000:]
