"""Backward through prepare: dv, dbeta, dg and the w- and A-terms of dk (``gdn_bwd_wy_kernel``), then
dq and dk as sums of their value heads' terms, through the q/k L2 norm when the op applied it
(``gdn_bwd_qk_finish_kernel``); launcher ``bwd_prepare``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import CHUNK_SIZE
from . import launching
from .helpers import _chunk_cumsum, _chunk_gates, _mm, _row_off, _rsum, _tok_load, _tok_store
from .launching import NUM_WARPS, dims, triton_cdiv


@triton.jit
def gdn_bwd_wy_kernel(
    k, v, beta, gc, tinv, dw, du, dkv, dgc, dv_out, dbeta_out, dg_out,
    T,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Per (chunk, value head), back through prepare: w = Tinv (beta exp(gc) k), u = Tinv (beta v),
    Tinv = (I + A)^-1, A = strictly_lower(beta_i E_ij k_i.k_j). Stores dv, dbeta and dg (the in-chunk
    reverse cumsum of the finished d(gc)); adds the w- and A-terms of dk into ``dkv`` in place (fp32,
    per value head, holding ``bwd_inter``'s terms).

    K and V are walked in ``BC``-wide column blocks: d(Tinv) and k k^T collect over them, so no tile
    is wider than ``BC`` (the whole-row version spilled registers and ran twice as long). ``du`` is
    d(vn), the backward state pass's buffer. Dot operands use the token dtype.
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // Hv, i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    o_i = tl.arange(0, BT)
    m_t = i_t * BT + o_i < T
    row = _row_off(i_b, i_t, T, Hv, BT) + i_h + o_i * Hv
    dt = k.dtype.element_ty
    b_beta = tl.load(beta + row, mask=m_t, other=0.0).to(tl.float32)
    b_gc, _, _ = _chunk_gates(gc, i_b, i_h, i_t, T, Hv, BT)
    b_egc = tl.exp(b_gc)
    b_T = tl.trans(_tok_load(tinv, i_b, i_h, T, Hv, BT, i_t, 0, BT, BT))  # Tinv^T, fp32
    b_Tc = b_T.to(dt)

    # through w: dTinv += dw (beta exp(gc) k)^T, d(beta exp(gc) k) = Tinv^T dw
    b_dT = tl.full([BT, BT], 0.0, tl.float32)
    b_kk = tl.full([BT, BT], 0.0, tl.float32)
    b_kdkb = tl.full([BT], 0.0, tl.float32)
    for i_c in tl.static_range(K // BC):
        b_k = _tok_load(k, i_b, i_hk, T, Hk, K, i_t, i_c * BC, BT, BC)
        b_kk += _mm(b_k, tl.trans(b_k), PREC, UPCAST)
        b_dw = _tok_load(dw, i_b, i_h, T, Hv, K, i_t, i_c * BC, BT, BC).to(dt)
        b_kb = (b_k.to(tl.float32) * (b_beta * b_egc)[:, None]).to(dt)
        b_dT += _mm(b_dw, tl.trans(b_kb), PREC, UPCAST)
        b_dkb = _mm(b_Tc, b_dw, PREC, UPCAST)
        b_kdkb += _rsum(b_dkb * b_k.to(tl.float32), axis=1)
        b_dk = _tok_load(dkv, i_b, i_h, T, Hv, K, i_t, i_c * BC, BT, BC) + b_dkb * (b_beta * b_egc)[:, None]
        _tok_store(dkv, i_b, i_h, T, Hv, K, i_t, i_c * BC, BT, BC, b_dk)
    b_dbeta = b_kdkb * b_egc
    b_dgc = tl.load(dgc + row, mask=m_t, other=0.0) + b_kdkb * b_beta * b_egc

    # through u: dTinv += du (beta v)^T, d(beta v) = Tinv^T du
    for i_c in tl.static_range(V // BC):
        b_du = _tok_load(du, i_b, i_h, T, Hv, V, i_t, i_c * BC, BT, BC).to(dt)
        b_v = _tok_load(v, i_b, i_h, T, Hv, V, i_t, i_c * BC, BT, BC)
        b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(dt)
        b_dT += _mm(b_du, tl.trans(b_vb), PREC, UPCAST)
        b_dvb = _mm(b_Tc, b_du, PREC, UPCAST)
        _tok_store(dv_out, i_b, i_h, T, Hv, V, i_t, i_c * BC, BT, BC,
                   (b_dvb * b_beta[:, None]).to(dv_out.dtype.element_ty))
        b_dbeta += _rsum(b_dvb * b_v.to(tl.float32), axis=1)

    # through Tinv: dA = -Tinv^T dTinv Tinv^T, kept on the strictly lower part
    b_dA = -_mm(_mm(b_T, b_dT, PREC, UPCAST), b_T, PREC, UPCAST)
    lower = o_i[:, None] > o_i[None, :]
    b_dAE = tl.where(lower, b_dA * tl.exp(tl.where(lower, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0)
    b_dbeta += _rsum(b_dAE * b_kk, axis=1)
    b_dAb = b_dAE * b_beta[:, None]
    b_z = b_dAb * b_kk
    b_dgc += _rsum(b_z, axis=1) - _rsum(b_z, axis=0)
    # A's two factors of k: dk += (dA_b + dA_b^T) k, summed in fp32 and rounded once for the dot
    b_dAs = (b_dAb + tl.trans(b_dAb)).to(dt)
    for i_c in tl.static_range(K // BC):
        b_k = _tok_load(k, i_b, i_hk, T, Hk, K, i_t, i_c * BC, BT, BC)
        b_dk = _tok_load(dkv, i_b, i_h, T, Hv, K, i_t, i_c * BC, BT, BC) + _mm(b_dAs, b_k, PREC, UPCAST)
        _tok_store(dkv, i_b, i_h, T, Hv, K, i_t, i_c * BC, BT, BC, b_dk)
    tl.store(dbeta_out + row, b_dbeta, mask=m_t)
    # gc = in-chunk cumsum of g  =>  dg_t = sum_{i >= t} dgc_i
    tl.store(dg_out + row, _chunk_cumsum(b_dgc, BT, True), mask=m_t)


@triton.jit
def gdn_bwd_qk_finish_kernel(q, k, dqv, dkv, q_rstd, k_rstd, dq_out, dk_out, N,
                             Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, BR: tl.constexpr,
                             L2NORM: tl.constexpr):
    """Rows ``(b, t, key head)``: dq and dk as the sums of their value heads' fp32 terms and, with
    ``L2NORM``, through the q/k L2 norm (``q``/``k`` the normalised inputs, ``*_rstd`` their rstd:
    ``dx = r (dy - y (y . dy))``), in fp32 before the one store in the output dtype."""
    G: tl.constexpr = Hv // Hk
    # int64 rows: N = B * T * Hk rows of K (or of Hv / Hk value heads of K) pass 2^31 elements
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m = (rows < N)[:, None]
    cols = tl.arange(0, K)[None, :]
    vrows = (rows // Hk) * Hv + (rows % Hk) * G  # first value head of each row's key head
    off = rows[:, None] * K + cols
    for which in tl.static_range(2):
        src = dqv if which == 0 else dkv
        b_d = tl.full([BR, K], 0.0, tl.float32)
        for i_g in tl.static_range(G):
            b_d += tl.load(src + (vrows + i_g)[:, None] * K + cols, mask=m, other=0.0)
        if L2NORM:
            b_y = tl.load((q if which == 0 else k) + off, mask=m, other=0.0).to(tl.float32)
            b_r = tl.load((q_rstd if which == 0 else k_rstd) + rows, mask=rows < N, other=0.0)
            b_d = b_r[:, None] * (b_d - b_y * _rsum(b_y * b_d, axis=1)[:, None])
        dst = dq_out if which == 0 else dk_out
        tl.store(dst + off, b_d.to(dst.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------- launcher


# column block of the prepare backward (tiles wider than 64 spilled registers on an H200)
WY_BC = 64
QK_FINISH_ROWS = 32


def bwd_prepare(q, k, v, beta, gc, tinv, dw, du, dqv, dkv, dgc, qk_grad_dtype=None, rstd=None):
    """The backward through prepare, and the finished q/k gradients -> (dq, dk [B,T,Hk,K], dv,
    dbeta fp32, dg fp32). ``dqv``/``dkv`` are ``bwd_inter``'s per-value-head terms (``dkv`` is
    updated in place); ``du`` is d(vn) from the backward state pass.
    ``rstd = (q_rstd, k_rstd)``: q and k are L2-normalised inputs and dq/dk are returned w.r.t. the
    raw ones. dq/dk come in ``qk_grad_dtype`` (default q's)."""
    B, T, Hk, Hv, K, V, NT = dims(k, v)
    dv = torch.empty(B, T, Hv, V, device=k.device, dtype=v.dtype)
    dbeta = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    dg = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    launching.launch(gdn_bwd_wy_kernel, (NT, B * Hv),
        k, v, beta, gc, tinv, dw, du, dkv, dgc, dv, dbeta, dg, T,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BC=min(WY_BC, K, V), num_warps=NUM_WARPS["bwd_wy"],
        **launching.flags(k.dtype))
    out = dict(device=k.device, dtype=qk_grad_dtype or q.dtype)
    dq, dk = torch.empty(B, T, Hk, K, **out), torch.empty(B, T, Hk, K, **out)
    q_rstd, k_rstd = rstd if rstd is not None else (dbeta, dbeta)
    N = B * T * Hk
    launching.launch(gdn_bwd_qk_finish_kernel, (triton_cdiv(N, QK_FINISH_ROWS),),
        q, k, dqv, dkv, q_rstd, k_rstd, dq, dk, N, Hk=Hk, Hv=Hv, K=K, BR=QK_FINISH_ROWS, L2NORM=rstd is not None,
        num_warps=4)
    return dq, dk, dv, dbeta, dg
