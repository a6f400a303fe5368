"""Forward, stage 1 ("prepare", state-independent, fully parallel over chunks): per chunk and value
head, the gate cumsum ``gc``, ``Tinv = (I + A)^-1`` of the strictly lower
``A = beta_i E_ij k_i.k_j`` (``E_ij = exp(gc_i - gc_j)``), and ``w = Tinv (beta exp(gc) k)``,
``u = Tinv (beta v)``: ``gdn_fwd_prepare_kernel`` and its launcher ``fwd_prepare``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import CHUNK_SIZE
from . import launching
from .helpers import _chunk_cumsum, _mm, _row_off, _rsum, _tok_load, _tok_store
from .launching import NUM_WARPS, dims


@triton.jit
def _diagonal_block_inverse(A, BT: tl.constexpr, BS: tl.constexpr):
    """``(I + A_d)^-1``, ``A_d`` the ``BS x BS`` diagonal blocks of the strictly lower ``A [BT, BT]``:
    forward substitution, one row of every block per step (``BS - 1`` steps), in fp32 on the CUDA
    cores. Row ``s`` of a block's inverse is ``e_s - sum_{j<s} A_sj D_j``: only finished rows are
    read, so no intermediate is larger than the inverse itself."""
    NB: tl.constexpr = BT // BS
    o_b = tl.arange(0, NB)
    same_block = o_b[:, None, None, None] == o_b[None, None, :, None]  # [NB, 1, NB, 1]
    b_A3 = _rsum(tl.where(same_block, tl.reshape(A, [NB, BS, NB, BS]), 0.0), axis=2)  # [NB, BS, BS]
    o = tl.arange(0, BS)
    rows, cols = o[None, :, None], o[None, None, :]
    b_D3 = tl.where(rows == cols, 1.0, 0.0) + tl.zeros([NB, BS, BS], tl.float32)
    for s in tl.static_range(1, BS):
        b_a = _rsum(tl.where(rows == s, b_A3, 0.0), axis=1)  # [NB, BS]: row s of each block, zero from s on
        b_t = _rsum(b_a[:, :, None] * b_D3, axis=1)
        b_D3 = tl.where(rows == s, tl.where(cols == s, 1.0, 0.0) - b_t[:, None, :], b_D3)
    return tl.reshape(tl.where(same_block, b_D3[:, :, None, :], 0.0), [BT, BT])


@triton.jit
def _doubling_inverse(A, BT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``(I + A)^-1`` by recursive doubling, on the tensor cores only (``BS = 1``, the default: the
    fastest on an H200). With ``D`` the inverse of the diagonal blocks of size ``s``, the inverse of
    those of size ``2s`` is ``D - D A_s D``, ``A_s`` the lower ``s x s`` block inside each ``2s`` block:
    ``[[X, 0], [Y, Z]]^-1 = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]``. Every factor is a block of ``A`` or of
    the inverse itself, so nothing grows as the power series' terms do; ``2 log2(BT)`` dots."""
    o_i = tl.arange(0, BT)
    b_T = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for level in tl.static_range(BT.bit_length() - 1):
        s = 1 << level
        lower_half = ((o_i[:, None] // s) == (o_i[None, :] // s) + 1) & (o_i[:, None] // (2 * s) == o_i[None, :] // (2 * s))
        b_T = b_T - _mm(_mm(b_T, tl.where(lower_half, A, 0.0), PREC, UPCAST), b_T, PREC, UPCAST)
    return b_T


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``(I + A)^-1`` for a strictly lower ``A [BT, BT]`` (fp32) by blocked forward substitution.

    Why not the power series ``(I - A)(I + A^2)(I + A^4)...``: when keys correlate (post-SiLU keys,
    all positive after the L2 norm) and decay is weak, the powers of ``A`` reach ~1e7 while the
    inverse stays O(1), and the product cancels to garbage (NaN in bf16 and fp32 on an H200). Here
    no intermediate is larger than the inverse's own blocks.

    With ``D = (I + A_d)^-1`` (diagonal blocks) and ``A_o = A - A_d`` (strictly block lower),
    ``T = D (I - A_o T)``. Iterating ``T <- D - (D A_o) T`` from ``T = D`` finishes one more block row
    per step and reads only finished rows: ``D A_o`` is exactly zero on and above the block
    diagonal, so the unfinished rows meet only exact zeros. ``BT/BS - 1`` steps, two dots each.
    ``BS = 1``: ``_doubling_inverse`` instead."""
    if BS == 1:
        return _doubling_inverse(A, BT, PREC, UPCAST)
    NB: tl.constexpr = BT // BS
    b_D = _diagonal_block_inverse(A, BT, BS)
    o_i = tl.arange(0, BT)
    b_Ao = tl.where((o_i[:, None] // BS) > (o_i[None, :] // BS), A, 0.0)
    b_N = _mm(b_D, b_Ao, PREC, UPCAST)
    b_T = b_D
    for _ in tl.static_range(NB - 1):
        b_T = b_D - _mm(b_N, b_T, PREC, UPCAST)
    return b_T


@triton.jit
def gdn_fwd_prepare_kernel(
    k, v, g, beta, gc_out, w_out, u_out, tinv_out,
    T,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BS: tl.constexpr, STORE_TINV: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Per (chunk, value head): gate cumsum, Tinv = (I+A)^-1 (stored if ``STORE_TINV``), w and u.
    Fully parallel."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // Hv, i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    o_i = tl.arange(0, BT)
    m_t = i_t * BT + o_i < T
    row = _row_off(i_b, i_t, T, Hv, BT) + i_h + o_i * Hv

    b_g = tl.load(g + row, mask=m_t, other=0.0).to(tl.float32)
    b_gc = _chunk_cumsum(b_g, BT, False)
    tl.store(gc_out + row, b_gc, mask=m_t)
    b_beta = tl.load(beta + row, mask=m_t, other=0.0).to(tl.float32)

    b_k = _tok_load(k, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
    b_v = _tok_load(v, i_b, i_h, T, Hv, V, i_t, 0, BT, V)

    lower = o_i[:, None] > o_i[None, :]
    b_E = tl.exp(tl.where(lower, b_gc[:, None] - b_gc[None, :], 0.0))
    b_kk = _mm(b_k, tl.trans(b_k), PREC, UPCAST)
    b_A = tl.where(lower, b_kk * b_E * b_beta[:, None], 0.0)

    b_T = _unit_lower_inverse(b_A, BT, BS, PREC, UPCAST)
    if STORE_TINV:
        _tok_store(tinv_out, i_b, i_h, T, Hv, BT, i_t, 0, BT, BT, b_T)

    dt = b_k.dtype
    b_kb = (b_k.to(tl.float32) * (b_beta * tl.exp(b_gc))[:, None]).to(dt)
    b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(dt)
    b_Tc = b_T.to(dt)
    b_w = _mm(b_Tc, b_kb, PREC, UPCAST)
    b_u = _mm(b_Tc, b_vb, PREC, UPCAST)
    _tok_store(w_out, i_b, i_h, T, Hv, K, i_t, 0, BT, K, b_w.to(w_out.dtype.element_ty))
    _tok_store(u_out, i_b, i_h, T, Hv, V, i_t, 0, BT, V, b_u.to(u_out.dtype.element_ty))


# ----------------------------------------------------------------------------- launcher


# prepare's chunk inverse: 1 is recursive doubling on the tensor cores alone (12 dots); BS > 1 inverts
# BS-row diagonal blocks by forward substitution (on the CUDA cores, BS - 1 steps) before its blocked
# steps (CHUNK_SIZE / BS - 1 of them). Both stable (tests/kernels/test_gdn_stress.py); on an H200 at
# 16K tokens prepare took 0.443 ms with 1, 0.455 with 8, 0.562 with 16
# (results/gdn_kernels_2026-12-02_NVIDIA-H200_blocked-inverse.md)
INVERSE_BLOCK = 1


def fwd_prepare(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, store_tinv: bool = True):
    """-> (gc fp32 [B,T,Hv], w [B,T,Hv,K], u [B,T,Hv,V] in k's dtype, tinv fp32 [B,T,Hv,64]).

    Only the backward reads ``tinv``: a forward whose caller recomputes prepare for its backward
    passes ``store_tinv=False`` (tinv is then None), which spares an fp32 ``[B,T,Hv,64]`` write."""
    B, T, Hk, Hv, K, V, NT = dims(k, v)
    gc = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    w = torch.empty(B, T, Hv, K, device=k.device, dtype=k.dtype)
    u = torch.empty(B, T, Hv, V, device=k.device, dtype=k.dtype)
    tinv = torch.empty(B, T, Hv, CHUNK_SIZE, device=k.device, dtype=torch.float32) if store_tinv else None
    # without tinv the kernel gets gc as its tinv pointer, which STORE_TINV=False never writes
    launching.launch(gdn_fwd_prepare_kernel, (NT, B * Hv),
        k, v, g, beta, gc, w, u, tinv if store_tinv else gc, T, Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE,
        BS=INVERSE_BLOCK, STORE_TINV=store_tinv, num_warps=NUM_WARPS["prepare"], **launching.flags(k.dtype))
    return gc, w, u, tinv
