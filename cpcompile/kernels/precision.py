"""Kernels keep their own precision under an ambient `torch.autocast`.

cpcompile's kernels are handed tensors at a precision already chosen (the SDPA rewrite casts Q/K/V
to the precision autocast gives SDPA; GDN keeps its state and decay in fp32) and make their own
choices inside (fp32 merges and accumulators). Autocast would override those choices behind their
back: it applies to the ATen calls inside a custom op's implementation as well, rounding matmuls
to bf16. So each runs with autocast off on its tensors' device.
"""
from __future__ import annotations

import functools

import torch


def without_autocast(kernel):
    """Run `kernel(x, ...)` with autocast off on the device of its first argument, a tensor."""

    @functools.wraps(kernel)
    def run(x, *args, **kwargs):
        with torch.autocast(x.device.type, enabled=False):
            return kernel(x, *args, **kwargs)

    return run
