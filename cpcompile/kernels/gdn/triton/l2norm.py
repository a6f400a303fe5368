"""The q/k L2 norm over the last dim, forward (``gdn_l2norm_fwd_kernel``, launcher ``l2norm_fwd``);
its backward is part of ``bwd_prepare``'s q/k finish.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import L2NORM_EPS
from . import launching
from .helpers import _rsum
from .launching import triton_cdiv


@triton.jit
def gdn_l2norm_fwd_kernel(x, y, rstd, N, eps, D: tl.constexpr, BR: tl.constexpr):
    """Rows of ``x [N, D]``: ``y = x * rsqrt(sum(x^2) + eps)`` (in x's dtype), ``rstd`` fp32 [N]."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # int64: N * D passes 2^31
    m = rows < N
    off = rows[:, None] * D + tl.arange(0, D)[None, :]
    b_x = tl.load(x + off, mask=m[:, None], other=0.0).to(tl.float32)
    b_r = tl.rsqrt(_rsum(b_x * b_x, axis=1) + eps)
    tl.store(y + off, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m[:, None])
    tl.store(rstd + rows, b_r, mask=m)


# ----------------------------------------------------------------------------- launcher


L2NORM_ROWS = 32


def l2norm_fwd(x: Tensor, eps: float = L2NORM_EPS):
    """-> (x / sqrt(sum(x^2) + eps) in x's dtype, rstd fp32 [...]) over the last dim."""
    D = x.shape[-1]
    N = x.numel() // D
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    launching.launch(gdn_l2norm_fwd_kernel, (triton_cdiv(N, L2NORM_ROWS),), x, y, rstd, N, eps, D=D,
                     BR=L2NORM_ROWS, num_warps=4)
    return y, rstd
