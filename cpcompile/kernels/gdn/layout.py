"""The memory layout the GDN core's q, k and v should reach it in.

They come out of the layer as token-strided views of the conv's `[B, C, T]` output (on the eager
triton backend on CUDA, of the Triton conv's `[B, T, C]` output: q and k contiguous after their
float32 cast, v a view with C between tokens). Eagerly the core's kernels copy them to
`[B, T, H, D]` themselves (after casting q and k to v's dtype, the cheaper copy). Under `torch.compile` the fused kernels that make them can write that layout at no
cost, while inductor would otherwise hand the custom op the eager strides (a transposing copy
each, in the forward, the replay and the backward).
"""
from __future__ import annotations

import torch


def contiguous_when_compiled(x: torch.Tensor) -> torch.Tensor:
    """`x.contiguous()` when Dynamo traces the call, else `x` (also under `torch.export`: a CP
    region's graph calls this function, so that a compiled layer inlining the region gets the copy,
    `passes/gdn/conv_halo.py`)."""
    return x.contiguous() if torch.compiler.is_dynamo_compiling() else x
