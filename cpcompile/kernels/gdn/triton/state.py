"""Forward, stage 2: the chunk-sequential state pass, parallel over (value block, batch*head):
every chunk's entering state, its updates ``vn = u - w h`` and the final state
(``gdn_fwd_state_kernel``, launcher ``fwd_state``). ``_fwd_state_loop`` also serves the
State-P2P summary (``p2p_summary.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import CHUNK_SIZE
from . import launching
from .helpers import _chunk_gates, _mat_ptr, _mm, _tok_load, _tok_store
from .launching import NUM_WARPS, dims, stages, state_bv


@triton.jit
def _fwd_state_loop(k, w, u, gc, vnbuf, st_base, b_h, T, c_begin, c_end, i_b, i_h, i_hk, col0, u_col0,
                    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NS: tl.constexpr,
                    BT: tl.constexpr, BV: tl.constexpr, HS: tl.constexpr, STORE_H: tl.constexpr,
                    STORE_VN: tl.constexpr, WITH_U: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Steps state columns ``[col0, +BV)`` through chunks ``[c_begin, c_end)`` -> the leaving state.
    ``WITH_U``: they are value columns, fed by u's columns ``[u_col0, +BV)`` (else identity columns);
    ``STORE_H``: store the entering state of every ``HS``-th chunk; ``STORE_VN``: the updates."""
    for i_t in range(c_begin, c_end):
        if STORE_H:
            if i_t % HS == 0:
                # int64: (chunks / HS) * Hv * K * NS passes 2^31 at 512K tokens (Hv 16, K = NS = 128)
                p_hs = _mat_ptr(st_base + tl.cast(i_t // HS, tl.int64) * (Hv * K * NS), NS, col0, K, BV)
                tl.store(p_hs, b_h.to(st_base.dtype.element_ty))
        b_w = _tok_load(w, i_b, i_h, T, Hv, K, i_t, 0, BT, K)
        b_vn = -_mm(b_w, b_h.to(b_w.dtype), PREC, UPCAST)
        if WITH_U:
            b_vn += _tok_load(u, i_b, i_h, T, Hv, V, i_t, u_col0, BT, BV).to(tl.float32)
        if STORE_VN:
            _tok_store(vnbuf, i_b, i_h, T, Hv, NS, i_t, col0, BT, BV, b_vn.to(vnbuf.dtype.element_ty))
        b_gc, b_gl, m_t = _chunk_gates(gc, i_b, i_h, i_t, T, Hv, BT)
        b_k = _tok_load(k, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
        # (D k)^T vn == k^T (D vn): scale the small [BT, BV] tile, feed k to the dot untouched
        b_vd = b_vn * tl.where(m_t, tl.exp(b_gl - b_gc), 0.0)[:, None]
        b_h = b_h * tl.exp(b_gl) + _mm(tl.trans(b_k), b_vd.to(b_k.dtype), PREC, UPCAST)
    return b_h


@triton.jit
def gdn_fwd_state_kernel(
    k, w, u, gc, h0, hbuf, vnbuf, ht,
    T, NT,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, STORE_VN: tl.constexpr,
    USE_H0: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Sequential over chunks, parallel over (value block, batch*head): the entering state of every
    chunk (``hbuf``), with ``STORE_VN`` its updates ``vn`` (``vnbuf``), and the final state (``ht``, fp32)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // Hv, i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    col0 = i_v * BV
    b_h = tl.full([K, BV], 0.0, tl.float32)
    if USE_H0:
        b_h = tl.load(_mat_ptr(h0 + i_bh.to(tl.int64) * K * V, V, col0, K, BV)).to(tl.float32)
    st_base = hbuf + i_b.to(tl.int64) * NT * Hv * K * V + i_h * K * V
    b_h = _fwd_state_loop(k, w, u, gc, vnbuf, st_base, b_h, T, 0, NT, i_b, i_h, i_hk, col0, col0,
                          Hk, Hv, K, V, V, BT, BV, 1, True, STORE_VN, True, PREC, UPCAST)
    tl.store(_mat_ptr(ht + i_bh.to(tl.int64) * K * V, V, col0, K, BV), b_h)


# ----------------------------------------------------------------------------- launcher


def fwd_state(k: Tensor, w: Tensor, u: Tensor, gc: Tensor, h0: Tensor | None, store_vn: bool = True):
    """Chunk-sequential state pass from ``h0`` (None: zero).

    -> (hbuf [B,NT,Hv,K,V] entering state of every chunk, vnbuf [B,T,Hv,V] updates (None unless
    ``store_vn``), ht fp32 [B,Hv,K,V]).
    """
    B, T, Hk, Hv, K, V, NT = dims(k, u)
    BV = state_bv("state", K, V)
    hbuf = torch.empty(B, NT, Hv, K, V, device=k.device, dtype=k.dtype)
    vnbuf = torch.empty(B, T, Hv, V, device=k.device, dtype=k.dtype) if store_vn else None
    ht = torch.empty(B, Hv, K, V, device=k.device, dtype=torch.float32)
    launching.launch(gdn_fwd_state_kernel, (V // BV, B * Hv),
        k, w, u, gc, h0 if h0 is not None else ht, hbuf, vnbuf if store_vn else hbuf, ht, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BV=BV, STORE_VN=store_vn, USE_H0=h0 is not None,
        num_warps=NUM_WARPS["state"], num_stages=stages("state", k.dtype), **launching.flags(k.dtype))
    return hbuf, vnbuf, ht
