"""benchmarks/overlap_timeline.py reads a profiler trace right (a synthetic Chrome trace; the
script itself needs a CUDA GPU)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import overlap_timeline  # noqa: E402


def _trace(gpu_us: list[float]) -> dict:
    """One backward step on the autograd thread: kernel, launch, launch, two kernels, wait, kernel, wait."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "cp_backward", "ts": 0, "dur": 1000, "tid": 1}]
    ts, correlation = 10, 0

    def op(name):
        nonlocal ts
        events.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": 1, "tid": 2})
        ts += 10

    def kernel(us):
        nonlocal ts, correlation
        correlation += 1
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": ts, "dur": 1, "tid": 2,
                       "args": {"correlation": correlation}})
        events.append({"ph": "X", "cat": "kernel", "name": f"k{correlation}", "ts": 5000 + ts, "dur": us,
                       "args": {"correlation": correlation}})
        ts += 10

    kernel(gpu_us[0])
    op("_c10d_functional::reduce_scatter_tensor")
    op("_c10d_functional::reduce_scatter_tensor")
    kernel(gpu_us[1])
    kernel(gpu_us[2])
    op("_c10d_functional::wait_tensor")
    kernel(gpu_us[3])
    op("_c10d_functional::wait_tensor")
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2000, "dur": 1, "tid": 2})  # outside the phase
    return {"traceEvents": events}


def test_sequence_and_in_flight_compute():
    gpu_us = [random.uniform(10, 100) for _ in range(4)]
    (items,) = overlap_timeline.phase_sequences(_trace(gpu_us), "backward")
    summary = overlap_timeline.summarize(items)
    assert summary["sequence"].startswith(f"[1 kernels, {gpu_us[0] / 1e3:.2f} ms] L ")
    assert "L reduce_scatter_tensor L reduce_scatter_tensor [2 kernels" in summary["sequence"]
    assert summary["sequence"].endswith("ms] W")
    assert (summary["launches"], summary["waits"], summary["waits_without_compute"]) == (2, 2, 0)
    assert abs(summary["compute_ms"] - sum(gpu_us) / 1e3) < 1e-9
    assert abs(summary["in_flight_ms"] - sum(gpu_us[1:]) / 1e3) < 1e-9


def test_a_wait_right_after_its_launch_is_counted():
    items = [("L", "all_to_all_single"), ("W",), ("K", "k", 5.0), ("L", "all_to_all_single"), ("K", "k", 5.0), ("W",)]
    summary = overlap_timeline.summarize(items)
    assert summary["waits_without_compute"] == 1
    assert summary["in_flight_ms"] == 5.0 / 1e3
