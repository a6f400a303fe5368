"""`--profile` of the trainer benchmarks: PyTorch's profiler around one training step, then the
step's ops by self device time (which attention, GDN and matmul kernels it ran, and their share)."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def kernel_table(device: str, into: list[str], rows: int = 30) -> Iterator[None]:
    """Profile the block; append its table of ops by self device time (CPU time on a CPU) to `into`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    sort_by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    into.append(prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=90))
