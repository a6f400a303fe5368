"""Backward, the state pass: the intra-chunk part of d(vn) (``gdn_bwd_dv_local_kernel``, launcher
``bwd_dv_local``), then the reverse chunk-sequential pass for the state gradient
(``gdn_bwd_state_kernel``, launcher ``bwd_state``), plain or augmented: State-P2P's backward
summary carries an identity block beside the state gradient through every chunk, which ends as
``M^T``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import CHUNK_SIZE
from . import launching
from .helpers import _chunk_gates, _mat_ptr, _mm, _tok_load, _tok_store
from .launching import NUM_WARPS, stages, state_bv, triton_cdiv


@triton.jit
def gdn_bwd_dv_local_kernel(
    q, k, gc, do, dvl, scale,
    T,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Intra-chunk part of d(vn): ``scale * lower_incl(E q k^T)^T do``. Parallel over chunks."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // Hv, i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    o_i = tl.arange(0, BT)
    b_q = _tok_load(q, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
    b_k = _tok_load(k, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
    b_gc, b_gl, m_t = _chunk_gates(gc, i_b, i_h, i_t, T, Hv, BT)
    # transposed scores: st[j, i] = k_j . q_i * E_ij for i >= j
    b_st = _mm(b_k, tl.trans(b_q), PREC, UPCAST)
    upper = o_i[:, None] <= o_i[None, :]
    b_st = tl.where(upper, b_st * tl.exp(tl.where(upper, b_gc[None, :] - b_gc[:, None], 0.0)), 0.0) * scale
    b_do = _tok_load(do, i_b, i_h, T, Hv, V, i_t, 0, BT, V)
    b_dv = _mm(b_st.to(b_do.dtype), b_do, PREC, UPCAST)
    _tok_store(dvl, i_b, i_h, T, Hv, V, i_t, 0, BT, V, b_dv.to(dvl.dtype.element_ty))


@triton.jit
def _bwd_state_loop(q, k, w, gc, do, dvl, dvnbuf, st_base, b_dh, scale, T, NT, i_b, i_h, i_hk, col0, o_col0,
                    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NS: tl.constexpr,
                    BT: tl.constexpr, BV: tl.constexpr, WITH_OUT: tl.constexpr, STORE: tl.constexpr,
                    PREC: tl.constexpr, UPCAST: tl.constexpr):
    """The reverse chunk loop of ``gdn_bwd_state_kernel`` for state columns ``[col0, +BV)``;
    ``WITH_OUT``: they are value columns, fed by the outputs' gradient (``dvl`` and ``do`` columns
    ``[o_col0, +BV)``); ``STORE``: keep every chunk's state gradient and d(vn). -> the gradient of
    the entering state block."""
    for i_r in range(NT):
        i_t = NT - 1 - i_r
        if STORE:
            # int64: chunks * Hv * K * NS passes 2^31 at 512K tokens (Hv 16, K = NS = 128)
            p_s = _mat_ptr(st_base + tl.cast(i_t, tl.int64) * (Hv * K * NS), NS, col0, K, BV)
            tl.store(p_s, b_dh.to(st_base.dtype.element_ty))
        b_gc, b_gl, m_t = _chunk_gates(gc, i_b, i_h, i_t, T, Hv, BT)
        b_k = _tok_load(k, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
        dt = b_k.dtype
        b_dvn = _mm(b_k, b_dh.to(dt), PREC, UPCAST) * tl.where(m_t, tl.exp(b_gl - b_gc), 0.0)[:, None]
        b_w = _tok_load(w, i_b, i_h, T, Hv, K, i_t, 0, BT, K)
        b_dh = b_dh * tl.exp(b_gl)
        if WITH_OUT:
            b_dvn += _tok_load(dvl, i_b, i_h, T, Hv, V, i_t, o_col0, BT, BV).to(tl.float32)
            b_q = _tok_load(q, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
            b_do = _tok_load(do, i_b, i_h, T, Hv, V, i_t, o_col0, BT, BV).to(tl.float32)
            b_dog = (b_do * (tl.exp(b_gc) * scale)[:, None]).to(dt)
            b_dh += _mm(tl.trans(b_q), b_dog, PREC, UPCAST)
        if STORE:
            _tok_store(dvnbuf, i_b, i_h, T, Hv, NS, i_t, col0, BT, BV, b_dvn.to(dvnbuf.dtype.element_ty))
        b_dh -= _mm(tl.trans(b_w), b_dvn.to(dt), PREC, UPCAST)
    return b_dh


@triton.jit
def gdn_bwd_state_kernel(
    q, k, w, gc, do, dvl, dht, dhbuf, dvnbuf, dh0, scale,
    T, NT,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    NX: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Reverse sequential pass over chunks for the state gradient.

    With ``STORE``, ``dhbuf[c]`` holds the gradient w.r.t. the state *leaving* chunk c and ``dvnbuf``
    the full d(vn); ``dh0`` the gradient w.r.t. the entering state. Columns ``[0, NX)`` (augmented
    mode) start as ``I`` and receive no output gradient: they carry the transposed suffix products.
    """
    NS: tl.constexpr = NX + V
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // Hv, i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    col0 = i_v * BV
    o_k = tl.arange(0, K)
    o_c = col0 + tl.arange(0, BV)

    if NX > 0:
        b_dh = tl.where(o_k[:, None] == o_c[None, :], 1.0, 0.0)
    else:
        b_dh = tl.full([K, BV], 0.0, tl.float32)
        if USE_DHT:
            p = _mat_ptr(dht + i_bh.to(tl.int64) * K * V, V, col0, K, BV)
            b_dh = tl.load(p).to(tl.float32)

    st_base = dhbuf + i_b.to(tl.int64) * NT * Hv * K * NS + i_h * K * NS
    # value columns take the outputs' gradient, identity columns do not (branch outside the loop,
    # as in the forward state pass)
    if NX == 0:
        b_dh = _bwd_state_loop(q, k, w, gc, do, dvl, dvnbuf, st_base, b_dh, scale, T, NT, i_b, i_h, i_hk, col0, col0,
                               Hk, Hv, K, V, NS, BT, BV, True, STORE, PREC, UPCAST)
    elif col0 >= NX:
        b_dh = _bwd_state_loop(q, k, w, gc, do, dvl, dvnbuf, st_base, b_dh, scale, T, NT, i_b, i_h, i_hk, col0,
                               col0 - NX, Hk, Hv, K, V, NS, BT, BV, True, STORE, PREC, UPCAST)
    else:
        b_dh = _bwd_state_loop(q, k, w, gc, do, dvl, dvnbuf, st_base, b_dh, scale, T, NT, i_b, i_h, i_hk, col0, 0,
                               Hk, Hv, K, V, NS, BT, BV, False, STORE, PREC, UPCAST)

    p0 = _mat_ptr(dh0 + i_bh.to(tl.int64) * K * NS, NS, col0, K, BV)
    tl.store(p0, b_dh)


# ----------------------------------------------------------------------------- launcher


def bwd_dv_local(q, k, gc, do, scale):
    B, T, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    dvl = torch.empty(B, T, Hv, V, device=q.device, dtype=torch.float32)
    launching.launch(gdn_bwd_dv_local_kernel, (triton_cdiv(T, CHUNK_SIZE), B * Hv),
        q, k, gc, do, dvl, scale, T, Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE,
        num_warps=NUM_WARPS["dv_local"], **launching.flags(q.dtype))
    return dvl


def bwd_state(q, k, w, gc, do, dvl, dht, scale, ny: int = 0, store: bool = True):
    """Reverse state pass -> (dhbuf [B,NT,Hv,K,ny+V] grads of leaving states, dvnbuf [B,T,Hv,ny+V],
    dh0 fp32 [B,Hv,K,ny+V]). ``ny = K`` runs the augmented pass: ``dh0[..., :K]`` is then ``M^T``.
    dhbuf and dvnbuf are in the token dtype (every reader feeds them to a dot in that dtype); without
    ``store`` they are not kept (None): the State-P2P summary needs only dh0."""
    B, T, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    key = "bwd_state_aug" if ny else "bwd_state"
    NT, NS, BV = triton_cdiv(T, CHUNK_SIZE), ny + V, state_bv(key, K, V)
    dh0 = torch.empty(B, Hv, K, NS, device=q.device, dtype=torch.float32)
    dhbuf = torch.empty(B, NT, Hv, K, NS, device=q.device, dtype=q.dtype) if store else None
    dvnbuf = torch.empty(B, T, Hv, NS, device=q.device, dtype=q.dtype) if store else None
    launching.launch(gdn_bwd_state_kernel, (NS // BV, B * Hv),
        q, k, w, gc, do, dvl, dht if dht is not None else dh0, dhbuf if store else dh0, dvnbuf if store else dh0,
        dh0, scale, T, NT, Hk=Hk, Hv=Hv, K=K, V=V, NX=ny, BT=CHUNK_SIZE, BV=BV, USE_DHT=dht is not None, STORE=store,
        num_warps=NUM_WARPS[key], num_stages=stages(key, q.dtype), **launching.flags(q.dtype))
    return dhbuf, dvnbuf, dh0
