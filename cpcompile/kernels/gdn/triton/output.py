"""Forward, stage 3: the output from a plain state pass's per-chunk states and updates,
``o = scale (exp(gc) q h + lower_incl(E q k^T) vn)`` per (value block, chunk, batch*head)
(``gdn_fwd_output_kernel``, launcher ``fwd_output``). ``_chunk_output`` also serves the State-P2P
output (``p2p_output.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import CHUNK_SIZE
from . import launching
from .helpers import _chunk_gates, _mat_ptr, _mm, _tok_load, _tok_store
from .launching import NUM_WARPS, triton_cdiv


@triton.jit
def _chunk_output(b_q, b_k, b_h, b_vn, b_gc, scale, BT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``scale (exp(gc) q h + lower_incl(E q k^T) vn)`` of one chunk; ``h``/``vn`` in the dot dtype."""
    o_i = tl.arange(0, BT)
    b_s = _mm(b_q, tl.trans(b_k), PREC, UPCAST)
    incl = o_i[:, None] >= o_i[None, :]
    b_s = tl.where(incl, b_s * tl.exp(tl.where(incl, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0)
    b_o = _mm(b_q, b_h, PREC, UPCAST) * tl.exp(b_gc)[:, None]
    b_o += _mm(b_s.to(b_q.dtype), b_vn, PREC, UPCAST)
    return b_o * scale


@triton.jit
def gdn_fwd_output_kernel(
    q, k, gc, hbuf, vnbuf, o, scale,
    T, NT,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Per (value block, chunk, batch*head), from a plain state pass's per-chunk states/updates.
    Value block and chunk share grid axis 0 (value block fastest, the order of a (V/BV, NT) grid):
    axis 1 holds at most 65535 programs, 4M tokens of chunks."""
    NV: tl.constexpr = V // BV
    pid, i_bh = tl.program_id(0), tl.program_id(1)
    i_v, i_t = pid % NV, pid // NV
    i_b, i_h = i_bh // Hv, i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    b_q = _tok_load(q, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
    b_k = _tok_load(k, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
    b_gc, b_gl, m_t = _chunk_gates(gc, i_b, i_h, i_t, T, Hv, BT)
    st = hbuf + (i_b.to(tl.int64) * NT + i_t) * Hv * K * V + i_h * K * V
    b_h = tl.load(_mat_ptr(st, V, i_v * BV, K, BV))
    b_vn = _tok_load(vnbuf, i_b, i_h, T, Hv, V, i_t, i_v * BV, BT, BV)
    b_o = _chunk_output(b_q, b_k, b_h.to(b_q.dtype), b_vn.to(b_q.dtype), b_gc, scale, BT, PREC, UPCAST)
    _tok_store(o, i_b, i_h, T, Hv, V, i_t, i_v * BV, BT, BV, b_o.to(o.dtype.element_ty))


# ----------------------------------------------------------------------------- launcher


# value-column block of the plain output kernel
OUTPUT_BV = 64


def _output_bv(V: int) -> int:
    return min(OUTPUT_BV, V)


def fwd_output(q: Tensor, k: Tensor, gc: Tensor, hbuf: Tensor, vnbuf: Tensor, scale: float) -> Tensor:
    """Output from a plain state pass's per-chunk entering states and updates."""
    B, T, Hk, K = q.shape
    Hv, V = gc.shape[2], vnbuf.shape[-1]
    NT, BV = triton_cdiv(T, CHUNK_SIZE), _output_bv(V)
    o = torch.empty(B, T, Hv, V, device=q.device, dtype=q.dtype)
    launching.launch(gdn_fwd_output_kernel, (V // BV * NT, B * Hv),
        q, k, gc, hbuf, vnbuf, o, scale, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BV=BV, num_warps=NUM_WARPS["output"], **launching.flags(q.dtype))
    return o
