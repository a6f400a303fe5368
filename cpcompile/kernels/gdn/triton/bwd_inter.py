"""Backward, the state and intra-chunk terms: per (chunk, batch*head), dq, dk (output and state
terms), dw and the gate-gradient terms that need the state (``gdn_bwd_inter_kernel``, launcher
``bwd_inter``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import CHUNK_SIZE
from . import launching
from .helpers import _chunk_gates, _mat_ptr, _mm, _row_off, _rsum, _tok_load, _tok_store
from .launching import NUM_WARPS, stages, triton_cdiv


@triton.jit
def gdn_bwd_inter_kernel(
    q, k, w, u, gc, do, hbuf, dhbuf, dvnbuf, dq_out, dk_out, dw_out, dgc_out, scale,
    T, NT,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Per (chunk, batch*head): dq, dk (output and state terms), dw and the gate-gradient terms
    that need the state, looping over value blocks. Parallel over chunks.

    ``hbuf`` (the entering states) comes from a plain state pass run without storing its updates:
    they are rebuilt here as ``vn = u - w h`` from the same bf16 state the pass multiplied, which
    costs one dot per value block and saves a [B,T,Hv,V] buffer (its write and its read).
    ``dhbuf`` (gradients of the leaving states) and ``dvnbuf`` (d(vn)) come from the plain
    backward state pass.
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // Hv, i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    o_i = tl.arange(0, BT)

    b_q = _tok_load(q, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
    b_k = _tok_load(k, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
    dt = b_q.dtype
    b_gc, b_gl, m_t = _chunk_gates(gc, i_b, i_h, i_t, T, Hv, BT)

    b_w = _tok_load(w, i_b, i_h, T, Hv, K, i_t, 0, BT, K)
    sh = hbuf + (i_b.to(tl.int64) * NT + i_t) * Hv * K * V + i_h * K * V
    sd = dhbuf + (i_b.to(tl.int64) * NT + i_t) * Hv * K * V + i_h * K * V

    b_ds = tl.full([BT, BT], 0.0, tl.float32)
    b_dq = tl.full([BT, K], 0.0, tl.float32)
    b_dk = tl.full([BT, K], 0.0, tl.float32)
    b_dw = tl.full([BT, K], 0.0, tl.float32)
    b_hdh = tl.full([K, BV], 0.0, tl.float32)
    for i_v in range(V // BV):
        c0 = i_v * BV
        b_h = tl.load(_mat_ptr(sh, V, c0, K, BV)).to(dt)
        b_vn = _tok_load(u, i_b, i_h, T, Hv, V, i_t, c0, BT, BV).to(tl.float32) - _mm(b_w, b_h, PREC, UPCAST)
        b_dh = tl.load(_mat_ptr(sd, V, c0, K, BV)).to(tl.float32)
        b_dvn = _tok_load(dvnbuf, i_b, i_h, T, Hv, V, i_t, c0, BT, BV).to(tl.float32)
        b_do = _tok_load(do, i_b, i_h, T, Hv, V, i_t, c0, BT, BV)
        b_vn = b_vn.to(dt)
        b_ds += _mm(b_do.to(dt), tl.trans(b_vn), PREC, UPCAST)
        b_dq += _mm(b_do.to(dt), tl.trans(b_h), PREC, UPCAST)
        b_dk += _mm(b_vn, tl.trans(b_dh.to(dt)), PREC, UPCAST)
        b_dw += _mm(b_dvn.to(dt), tl.trans(b_h), PREC, UPCAST)
        b_hdh += b_h.to(tl.float32) * b_dh

    b_egc = tl.exp(b_gc)
    # output, inter-chunk: o += scale exp(gc) q h
    b_dq = b_dq * (b_egc * scale)[:, None]
    b_dgc = _rsum(b_dq * b_q.to(tl.float32), axis=1)
    # output, intra-chunk: o += scale lower_incl(E q k^T) vn
    incl = o_i[:, None] >= o_i[None, :]
    b_qk = _mm(b_q, tl.trans(b_k), PREC, UPCAST)
    b_ds = tl.where(incl, b_ds * tl.exp(tl.where(incl, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0) * scale
    b_p = b_ds * b_qk
    b_dgc += _rsum(b_p, axis=1) - _rsum(b_p, axis=0)
    b_dsc = b_ds.to(dt)
    b_dq += _mm(b_dsc, b_k, PREC, UPCAST)
    # state update: h' = exp(gl) h + (exp(gl - gc) k)^T vn
    b_dk = b_dk * tl.where(m_t, tl.exp(b_gl - b_gc), 0.0)[:, None]
    b_kdk = _rsum(b_dk * b_k.to(tl.float32), axis=1)
    b_dgc -= b_kdk
    b_dgl = _rsum(b_kdk, axis=0) + tl.exp(b_gl) * _rsum(_rsum(b_hdh, axis=1), axis=0)
    last = tl.minimum(BT, T - i_t * BT) - 1
    b_dgc += tl.where(o_i == last, b_dgl, 0.0)
    b_dk += _mm(tl.trans(b_dsc), b_q, PREC, UPCAST)

    _tok_store(dq_out, i_b, i_h, T, Hv, K, i_t, 0, BT, K, b_dq.to(dq_out.dtype.element_ty))
    _tok_store(dk_out, i_b, i_h, T, Hv, K, i_t, 0, BT, K, b_dk)
    _tok_store(dw_out, i_b, i_h, T, Hv, K, i_t, 0, BT, K, (-b_dw).to(dw_out.dtype.element_ty))
    tl.store(dgc_out + _row_off(i_b, i_t, T, Hv, BT) + i_h + o_i * Hv, b_dgc, mask=m_t)


# ----------------------------------------------------------------------------- launcher


def _bv(K: int, V: int) -> int:
    return min(64, K, V)


def bwd_inter(q, k, w, u, gc, do, hbuf, dhbuf, dvnbuf, scale):
    """-> (dq [B,T,Hv,K] token dtype, dk fp32 [B,T,Hv,K], dw [B,T,Hv,K] token dtype, dgc fp32 [B,T,Hv]):
    the state and intra-chunk terms per value head; ``bwd_prepare`` adds the rest to dk and sums
    the value heads. dq is complete here, so the token dtype is enough before its fp32 sum (as
    fla-core keeps it); dk still takes the prepare terms, so it stays fp32. ``hbuf`` comes from a
    state pass run with ``store_vn=False`` (the updates are rebuilt from ``w``, ``u``)."""
    B, T, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    NT, BV = triton_cdiv(T, CHUNK_SIZE), _bv(K, V)
    dq = torch.empty(B, T, Hv, K, device=q.device, dtype=q.dtype)
    dk = torch.empty(B, T, Hv, K, device=q.device, dtype=torch.float32)
    dw = torch.empty(B, T, Hv, K, device=q.device, dtype=q.dtype)  # read only as a dot operand
    dgc = torch.empty(B, T, Hv, device=q.device, dtype=torch.float32)
    launching.launch(gdn_bwd_inter_kernel, (NT, B * Hv),
        q, k, w, u, gc, do, hbuf, dhbuf, dvnbuf, dq, dk, dw, dgc, scale, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BV=BV,
        num_warps=NUM_WARPS["inter"], num_stages=stages("inter", q.dtype), **launching.flags(q.dtype))
    return dq, dk, dw, dgc

