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
# The log decay the Triton kernels see at a packed document's first token. The state entering the
# document is scaled by exp(-30) ~ 1e-13, far below fp32 rounding (6e-8), so nothing of the earlier
# document reaches this one at any precision the kernels compute in; and -30 is small enough that
# chunk-local gate sums keep their fp32 resolution (Qwen3.5's own gates reach such sums in a chunk).
RESET_LOG_DECAY = -30.0


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise CPInputError(f"unknown GDN backend {backend!r}; expected one of {BACKENDS}")


def reset_decay_at_starts(g: Tensor, starts: Tensor) -> Tensor:
    """`g [B, T, H]` with the log decay of every document start (`starts [B, T]`, bool) replaced by
    `RESET_LOG_DECAY`: the packed documents of the eager oracle, stated as gates for kernels that
    take none (the Triton ones). The replaced entries get no gradient: at a start the true
    recurrence multiplies the decay into a zero state, so it cannot change anything."""
    return g.masked_fill(starts[..., None], RESET_LOG_DECAY)


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` in x's dtype: the exact formula transformers uses, eps
    inside the root (Qwen3.5's layer casts to fp32 first and keeps fp32)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
