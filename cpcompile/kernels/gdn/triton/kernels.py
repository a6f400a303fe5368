"""Triton kernels for the chunked gated delta rule (GDN), chunk size ``BT`` (64).

Layouts (all contiguous): tokens ``[B, T, H, D]``; per-token gates ``[B, T, Hv]``; chunk states
``[B, NT, Hv, K, NS]``; per-token state-shaped rows ``[B, T, Hv, NS]``; states ``[B, Hv, K, NS]``.
Value head ``h`` reads key head ``h // (Hv // Hk)``.

Per chunk, entered with state ``h`` (``gc`` = in-chunk inclusive cumsum of ``g``, ``gl`` its last
value, ``E_ij = exp(gc_i - gc_j)``)::

    A   = strictly_lower(beta_i E_ij k_i.k_j),   Tinv = (I + A)^-1
    w   = Tinv (beta exp(gc) k),  u = Tinv (beta v)          # state-independent ("prepare")
    vn  = u - w h                                            # true per-token updates
    o   = scale (exp(gc) q h + lower_incl(E q k^T) vn)
    h'  = exp(gl) h + (exp(gl - gc) k)^T vn

State-P2P needs a segment's affine summary ``H_out = M H_in + S`` before ``H_in`` is known.
``S`` and the zero-state entering states ``h0_c`` come from a state pass from zero. ``M`` is the
product of the chunk transitions: identity columns that start as ``I`` and receive no value input hold,
at every chunk, the product ``P_c`` of the transitions so far. Given ``H_in``, chunk c's true entering
state is ``h0_c + P_c H_in``, and its updates follow from prepare's ``u``, ``w``.

- Forward (``gdn_p2p_summary_kernel``): the value columns run from zero over all chunks, one long
  program per column block and head. The identity columns run per group of ``HS`` chunks, each from
  ``I``, in many short programs that fill the SMs the long ones leave idle. A small chain
  (``gdn_p2p_chain_kernel``) then multiplies the group transitions into ``P`` at every group start
  and ``M``.
- Backward ("augmented" reverse pass, ``NX > 0`` in ``gdn_bwd_state_kernel``): the identity block
  rides beside the state gradient through every chunk and ends as ``M^T``.

Every dot goes through ``_mm`` so that the CPU interpreter (whose bf16 dot is unreliable) can
upcast operands to fp32; on a GPU, bf16 operands hit the tensor cores with fp32 accumulation.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _tok_offs(i_b, i_h, T, H, D, i_t, col0, BT: tl.constexpr, BD: tl.constexpr):
    """Offsets and row mask of rows ``[i_t*BT, +BT)``, columns ``[col0, +BD)`` of head ``i_h`` of a
    ``[B, T, H, D]`` tensor; rows past ``T`` are masked (they read as zero)."""
    rows = i_t * BT + tl.arange(0, BT)
    cols = col0 + tl.arange(0, BD)
    off = ((i_b.to(tl.int64) * T + rows) * H + i_h) * D
    return off[:, None] + cols[None, :], (rows < T)[:, None]


@triton.jit
def _tok_load(base, i_b, i_h, T, H, D, i_t, col0, BT: tl.constexpr, BD: tl.constexpr):
    off, m = _tok_offs(i_b, i_h, T, H, D, i_t, col0, BT, BD)
    return tl.load(base + off, mask=m, other=0.0)


@triton.jit
def _tok_store(base, i_b, i_h, T, H, D, i_t, col0, BT: tl.constexpr, BD: tl.constexpr, val):
    off, m = _tok_offs(i_b, i_h, T, H, D, i_t, col0, BT, BD)
    tl.store(base + off, val, mask=m)


@triton.jit
def _mat_ptr(base, ld, col0, R: tl.constexpr, C: tl.constexpr):
    """Pointers of an ``[R, C]`` tile at column ``col0`` of a row-major matrix with leading dim ``ld``."""
    return base + tl.arange(0, R)[:, None] * ld + col0 + tl.arange(0, C)[None, :]


# The CPU interpreter cannot call triton.language's own ``@jit`` helpers (``sum``, ``cumsum``, ...)
# when triton was imported before ``TRITON_INTERPRET=1`` was set (torch and transformers import it
# early): they were decorated as compiled functions. Under the interpreter these two helpers use
# builtins only; compiled code takes the plain ``tl.sum`` / ``tl.cumsum`` branch.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _rsum(x, axis: tl.constexpr):
    if _INTERPRET:
        return tl.reduce(x, axis, tl.standard._sum_combine)  # interpreter maps this to np.sum
    else:
        return tl.sum(x, axis=axis)


@triton.jit
def _chunk_cumsum(x, BT: tl.constexpr, REVERSE: tl.constexpr):
    """Inclusive (``REVERSE``: reverse-inclusive) cumulative sum of a [BT] vector."""
    if _INTERPRET:
        o = tl.arange(0, BT)
        if REVERSE:
            keep = o[:, None] <= o[None, :]
        else:
            keep = o[:, None] >= o[None, :]
        return tl.reduce(tl.where(keep, x[None, :], 0.0), 1, tl.standard._sum_combine)
    else:
        if REVERSE:
            return tl.sum(x, axis=0) - tl.cumsum(x, axis=0) + x
        else:
            return tl.cumsum(x, axis=0)


@triton.jit
def _row_off(i_b, i_t, T, H, BT: tl.constexpr):
    """Offset of the chunk's first token (row ``i_t * BT`` of batch ``i_b``) in a ``[B, T, H]`` tensor,
    in int64 like every offset that grows with B or T; the chunk's own rows add at most ``(BT-1) * H``."""
    return (i_b.to(tl.int64) * T + i_t * BT) * H


@triton.jit
def _chunk_gates(gc_ptr, i_b, i_h, i_t, T, Hv: tl.constexpr, BT: tl.constexpr):
    """(gc of the chunk [BT] (rows past T take gl), gl = gc at the chunk's last valid row, row mask)."""
    o_i = tl.arange(0, BT)
    m_t = i_t * BT + o_i < T
    base = gc_ptr + _row_off(i_b, i_t, T, Hv, BT) + i_h
    last = tl.minimum(BT, T - i_t * BT) - 1
    b_gl = tl.load(base + last * Hv)
    # rows past T behave as padding with g = 0: keeps every exp(gc_i - gc_j) with i >= j at most 1
    b_gc = tl.load(base + o_i * Hv, mask=m_t, other=0.0)
    b_gc = tl.where(m_t, b_gc, b_gl)
    return b_gc, b_gl, m_t


# ----------------------------------------------------------------------------- forward: prepare


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


# ----------------------------------------------------------------------------- forward: state pass


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


# ----------------------------------------------------------------------------- forward: State-P2P summary


@triton.jit
def gdn_p2p_summary_kernel(
    k, w, u, gc, hbuf, ht, gbuf,
    T, NT, BH,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, BVI: tl.constexpr, HS: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """A segment's zero-state pass and its group transitions, in one launch of two kinds of program.

    Programs ``[0, BH * V/BV)``: value block x batch*head, sequential over all chunks from zero; store
    ``h0`` of every ``HS``-th chunk into ``hbuf[..., K:]`` and ``S`` into ``ht[..., K:]``. They come
    first, so they start first, one per SM. The rest: identity block x batch*head x group of ``HS``
    chunks, each stepping ``I`` through its group only and storing the group's transition into
    ``gbuf`` [B, NG, Hv, K, K] fp32. They are short, and fill the SMs around the long programs.
    """
    NS: tl.constexpr = K + V
    NVP: tl.constexpr = V // BV
    NIC: tl.constexpr = K // BVI
    NG = (NT + HS - 1) // HS
    pid = tl.program_id(0)
    # the role branch sits outside the chunk loops: a run-time branch around a load inside a loop
    # keeps that load out of Triton's software pipeline
    if pid < NVP * BH:
        i_bh, i_v = pid // NVP, pid % NVP
        i_b, i_h = i_bh // Hv, i_bh % Hv
        col0 = K + i_v * BV
        st_base = hbuf + i_b.to(tl.int64) * NG * Hv * K * NS + i_h * K * NS
        b_h = _fwd_state_loop(k, w, u, gc, hbuf, st_base, tl.full([K, BV], 0.0, tl.float32), T, 0, NT,
                              i_b, i_h, i_h // (Hv // Hk), col0, i_v * BV,
                              Hk, Hv, K, V, NS, BT, BV, HS, True, False, True, PREC, UPCAST)
        tl.store(_mat_ptr(ht + i_bh.to(tl.int64) * K * NS, NS, col0, K, BV), b_h)
    else:
        q = pid - NVP * BH
        i_c, i_bh, i_g = q % NIC, (q // NIC) % BH, q // (NIC * BH)
        i_b, i_h = i_bh // Hv, i_bh % Hv
        c0 = i_c * BVI
        b_p = tl.where(tl.arange(0, K)[:, None] == (c0 + tl.arange(0, BVI))[None, :], 1.0, 0.0)
        b_p = _fwd_state_loop(k, w, u, gc, hbuf, hbuf, b_p, T, i_g * HS, tl.minimum(i_g * HS + HS, NT),
                              i_b, i_h, i_h // (Hv // Hk), c0, 0,
                              Hk, Hv, K, V, NS, BT, BVI, HS, False, False, False, PREC, UPCAST)
        tl.store(_mat_ptr(gbuf + ((i_b.to(tl.int64) * NG + i_g) * Hv + i_h) * K * K, K, c0, K, BVI), b_p)


@triton.jit
def gdn_p2p_chain_kernel(gbuf, hbuf, ht, NG, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BVC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``P_0 = I``, ``P_{g+1} = G_g P_g`` over the groups, fp32 (tf32 dots): stores ``P_g`` into
    ``hbuf[:, g, ..., :K]`` and ``M = P_NG`` into ``ht[..., :K]``. Per (column block, batch*head).

    The loop is bound by loading each K x K fp32 ``G_g``, not by its dot, and the tile is too large
    for a pipelined loop's shared memory: the next group's ``G`` is loaded into registers before
    this group's dot (0.22 -> 0.16 ms at 64K tokens with 32 columns a program)."""
    NS: tl.constexpr = K + V
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // Hv, i_bh % Hv
    c0 = i_c * BVC
    b_p = tl.where(tl.arange(0, K)[:, None] == (c0 + tl.arange(0, BVC))[None, :], 1.0, 0.0)
    b_g = tl.load(_mat_ptr(gbuf + (i_b.to(tl.int64) * NG * Hv + i_h) * K * K, K, 0, K, K))
    for i_g in range(NG):
        row = (i_b.to(tl.int64) * NG + i_g) * Hv + i_h
        # the last group loads its own G again (one wasted load in NG): the loop body needs no branch
        nxt = (i_b.to(tl.int64) * NG + tl.minimum(i_g + 1, NG - 1)) * Hv + i_h
        b_next = tl.load(_mat_ptr(gbuf + nxt * K * K, K, 0, K, K))
        tl.store(_mat_ptr(hbuf + row * K * NS, NS, c0, K, BVC), b_p.to(hbuf.dtype.element_ty))
        b_p = _mm(b_g, b_p, PREC, UPCAST)
        b_g = b_next
    tl.store(_mat_ptr(ht + i_bh.to(tl.int64) * K * NS, NS, c0, K, BVC), b_p)


# ----------------------------------------------------------------------------- forward: output


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


@triton.jit
def _p2p_chunk(q, k, w, u, gc, o, b_h, scale, T, i_b, i_h, i_hk, i_t, c0,
               Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
               BV: tl.constexpr, STEP: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Output of chunk ``i_t`` entered with state ``b_h`` (fp32 [K, BV]); -> the leaving state if ``STEP``."""
    b_q = _tok_load(q, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
    b_k = _tok_load(k, i_b, i_hk, T, Hk, K, i_t, 0, BT, K)
    b_w = _tok_load(w, i_b, i_h, T, Hv, K, i_t, 0, BT, K)
    b_gc, b_gl, m_t = _chunk_gates(gc, i_b, i_h, i_t, T, Hv, BT)
    dt = b_q.dtype
    b_hc = b_h.to(dt)
    b_vn = _tok_load(u, i_b, i_h, T, Hv, V, i_t, c0, BT, BV).to(tl.float32) - _mm(b_w, b_hc, PREC, UPCAST)
    b_o = _chunk_output(b_q, b_k, b_hc, b_vn.to(dt), b_gc, scale, BT, PREC, UPCAST)
    _tok_store(o, i_b, i_h, T, Hv, V, i_t, c0, BT, BV, b_o.to(o.dtype.element_ty))
    if STEP:
        b_vd = b_vn * tl.where(m_t, tl.exp(b_gl - b_gc), 0.0)[:, None]
        b_h = b_h * tl.exp(b_gl) + _mm(tl.trans(b_k), b_vd.to(dt), PREC, UPCAST)
    return b_h


@triton.jit
def gdn_p2p_output_kernel(
    q, k, w, u, gc, hbuf, hin, o, scale,
    T, NT,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    HS: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Output of a segment from its incoming state ``hin`` [B,Hv,K,V] and the summary's
    stored entering states ``hbuf = [P | h0]`` of every ``HS``-th chunk.

    Per (value block, group of HS chunks, batch*head): the group's entering state is rebuilt once,
    ``h = h0 + P hin``; each chunk then takes its updates from prepare's outputs, ``vn = u - w h``
    (so the summary stores no updates), and ``h`` steps through the chunk to the next one of the
    group (``HS > 1``: one state dot per chunk buys HS times fewer stored and read states).
    """
    NS: tl.constexpr = K + V
    NV: tl.constexpr = V // BV
    NG = (NT + HS - 1) // HS
    # value block and group share grid axis 0 (value block fastest), as in gdn_fwd_output_kernel
    pid, i_bh = tl.program_id(0), tl.program_id(1)
    i_v, i_s = pid % NV, pid // NV
    i_b, i_h = i_bh // Hv, i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    c0 = i_v * BV

    st = hbuf + ((i_b.to(tl.int64) * NG + i_s) * Hv + i_h) * K * NS
    b_p = tl.load(_mat_ptr(st, NS, 0, K, K))
    dt = b_p.dtype
    b_hin = tl.load(_mat_ptr(hin + i_bh.to(tl.int64) * K * V, V, c0, K, BV)).to(dt)
    b_h = tl.load(_mat_ptr(st, NS, K + c0, K, BV)).to(tl.float32) + _mm(b_p, b_hin, PREC, UPCAST)

    # the group's last chunk steps the state too (wasted, 1 in HS): a branch around it measured slower
    for i_t in range(i_s * HS, tl.minimum(i_s * HS + HS, NT)):
        b_h = _p2p_chunk(q, k, w, u, gc, o, b_h, scale, T, i_b, i_h, i_hk, i_t, c0,
                         Hk, Hv, K, V, BT, BV, HS > 1, PREC, UPCAST)


# ----------------------------------------------------------------------------- backward


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


# ----------------------------------------------------------------------------- q/k L2 norm


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
