"""What every GDN backend agrees on: the backend names, the chunk length, the q/k L2 norm.

Stated once here; the eager oracle, the Triton kernels, the layer-level ops and the Qwen3.5
adapter all read them from this module.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...errors import CPInputError

BACKENDS = ("eager", "triton")  # `eager`: pure-PyTorch oracle; `triton`: cpcompile's Triton kernels
CHUNK_SIZE = 64  # the Triton kernels' chunk length, and every backend's default
L2NORM_EPS = 1e-6  # transformers' (and fla's) epsilon for the q/k L2 norm, inside the root


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise CPInputError(f"unknown GDN backend {backend!r}; expected one of {BACKENDS}")


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` in x's dtype: the exact formula transformers uses, eps
    inside the root (Qwen3.5's layer casts to fp32 first and keeps fp32)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
