"""The ``@triton.jit`` building blocks every GDN stage kernel shares: the dot (``_mm``), token-tile
loads and stores, matrix-tile pointers, the interpreter-safe sum and chunk cumsum, chunk offsets
and gates.

Layouts (all contiguous): tokens ``[B, T, H, D]``; per-token gates ``[B, T, Hv]``; chunk states
``[B, NT, Hv, K, NS]``; per-token state-shaped rows ``[B, T, Hv, NS]``; states ``[B, Hv, K, NS]``.
Value head ``h`` reads key head ``h // (Hv // Hk)``.

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
