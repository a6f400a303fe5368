"""The GDN layer's causal depthwise conv with its SiLU, forward and backward, token-major.

Rows: ``x [B, L, C]`` (any strides; channel stride 1 reads coalesced), where L = T + K − 1 when
the K − 1 tokens of left context come in front (``halo``: the `history` contract, zeros or a CP
rank's halo; OFF = K − 1), else L = T and the left context is zeros (OFF = 0, no padded copy). Output ``y [B, T, C]``
contiguous in x's dtype; the K taps sum in fp32, as the conv kernels accumulate. With
``positions [B, T]`` output t reads the token `back` steps before it only when
``positions[t] >= back`` (`kernels.gdn.conv.conv_taps`): never a token of an earlier document.

Notation (token t of the output, 0 <= t < T; ``back = K − 1 − tap``):
    acc(t)   = bias + sum_tap w[tap] · ok(t, back) · in(t − back)      in(u) = x[u + OFF], 0 if u + OFF < 0
    y(t)     = silu(acc(t))                                              (OFF = K − 1 with the halo, else 0)
    gp(t)    = dy(t) · silu'(acc(t))                                     (0 outside [0, T))
    d_in(u)  = sum_tap w[tap] · ok(u + back, back) · gp(u + back)       for −OFF <= u < T
    dw[tap]  = sum_t gp(t) · ok(t, back) · in(t − back),   db = sum_t gp(t)

The backward recomputes acc at the K shifted token tiles it needs (re-reads of the same rows: cache
hits), so it keeps no activation; dw and db are summed per program in fp32 and the programs' partial
sums added by torch (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import launching
from .launching import triton_cdiv

# Tile and warps per kernel (memory-bound). Not tuned on a GPU yet (`benchmarks/gdn_conv.py --tune`);
# the backward's token tile is the smaller one as it keeps more fp32 tiles live (d_in, acc, gp, rows).
CONV_BT = {"fwd": 32, "bwd": 16}
CONV_BC = {"fwd": 128, "bwd": 128}
CONV_WARPS = {"fwd": 4, "bwd": 4}
# The backward's programs: enough to fill a GPU, each summing its own token range's dw in fp32.
BWD_TARGET_PROGRAMS = 2048


@triton.jit
def _gate(pos_ptr, s_pb, s_pt, b, t, T, back, HAS_POS: tl.constexpr):
    """ok(t, back) for tokens t [BT]: the tap may read back that far (always without positions)."""
    if HAS_POS:
        p = tl.load(pos_ptr + b * s_pb + t.to(tl.int64) * s_pt, mask=(t >= 0) & (t < T), other=0)
        return p >= back
    else:
        return t == t


@triton.jit
def _rows(x_ptr, s_xb, s_xt, s_xc, b, u, c, OFF, L, cmask):
    """in(u) for tokens u [BT] x channels c [BC], fp32 (zero left of the context and past L)."""
    r = u + OFF
    m = ((r >= 0) & (r < L))[:, None] & cmask[None, :]
    ptr = x_ptr + b * s_xb + r.to(tl.int64)[:, None] * s_xt + c.to(tl.int64)[None, :] * s_xc
    return tl.load(ptr, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _acc(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, b, t, c, cmask, T, OFF, L,
         K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr):
    """acc(t) [BT, BC] in fp32."""
    if HAS_BIAS:
        acc = tl.zeros((t.shape[0], c.shape[0]), tl.float32) + tl.load(bias_ptr + c, mask=cmask, other=0.0).to(
            tl.float32)[None, :]
    else:
        acc = tl.zeros((t.shape[0], c.shape[0]), tl.float32)
    for tap in tl.static_range(K):
        back = K - 1 - tap
        w = tl.load(w_ptr + c * s_wc + tap * s_wk, mask=cmask, other=0.0).to(tl.float32)
        rows = _rows(x_ptr, s_xb, s_xt, s_xc, b, t - back, c, OFF, L, cmask)
        ok = _gate(pos_ptr, s_pb, s_pt, b, t, T, back, HAS_POS)
        acc += tl.where(ok[:, None], rows, 0.0) * w[None, :]
    return acc


@triton.jit
def gdn_conv_fwd_kernel(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, y_ptr,
                        T, C, OFF, L, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr,
                        SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = i_t * BT + tl.arange(0, BT)
    c = i_c * BC + tl.arange(0, BC)
    cmask = c < C
    acc = _acc(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, b, t, c, cmask, T, OFF,
               L, K, HAS_BIAS, HAS_POS)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    off = (b * T + t.to(tl.int64))[:, None] * C + c[None, :]
    tl.store(y_ptr + off, acc.to(y_ptr.dtype.element_ty), mask=(t < T)[:, None] & cmask[None, :])


@triton.jit
def _grad_pre(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, dy_ptr, s_db, s_dt, s_dc,
              b, t, c, cmask, T, OFF, L, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr,
              SILU: tl.constexpr):
    """gp(t) [BT, BC] in fp32, zero for tokens outside [0, T)."""
    inside = (t >= 0) & (t < T)
    m = inside[:, None] & cmask[None, :]
    dy = tl.load(dy_ptr + b * s_db + t.to(tl.int64)[:, None] * s_dt + c.to(tl.int64)[None, :] * s_dc, mask=m,
                 other=0.0).to(tl.float32)
    if SILU:
        acc = _acc(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, b, t, c, cmask, T,
                   OFF, L, K, HAS_BIAS, HAS_POS)
        sig = tl.sigmoid(acc)
        dy = dy * sig * (1.0 + acc * (1.0 - sig))
    return tl.where(m, dy, 0.0)


@triton.jit
def _bwd_tile(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, dy_ptr, s_db, s_dt, s_dc,
              dx_ptr, b, u0, u_end, c, cmask, T, C, OFF, L, dw, db,
              K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, SILU: tl.constexpr,
              BT: tl.constexpr):
    """d_in for the tokens u in [u0, min(u0 + BT, u_end)), written to dx (row u + OFF); -> dw, db plus
    this tile's share."""
    u = u0 + tl.arange(0, BT)
    owned = (u < u_end) & (u + OFF >= 0)
    d_in = tl.zeros((BT, c.shape[0]), tl.float32)
    taps = tl.arange(0, KP)
    for tap in tl.static_range(K):
        back = K - 1 - tap
        w = tl.load(w_ptr + c * s_wc + tap * s_wk, mask=cmask, other=0.0).to(tl.float32)
        gp = _grad_pre(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, dy_ptr, s_db,
                       s_dt, s_dc, b, u + back, c, cmask, T, OFF, L, K, HAS_BIAS, HAS_POS, SILU)
        ok = _gate(pos_ptr, s_pb, s_pt, b, u + back, T, back, HAS_POS)
        d_in += tl.where(ok[:, None], gp, 0.0) * w[None, :]
    # this tile's own tokens: their gp once more (cache hits), for dw and db
    gp = _grad_pre(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, dy_ptr, s_db, s_dt,
                   s_dc, b, u, c, cmask, T, OFF, L, K, HAS_BIAS, HAS_POS, SILU)
    gp = tl.where(owned[:, None], gp, 0.0)
    db += tl.sum(gp, axis=0)
    for tap in tl.static_range(K):
        back = K - 1 - tap
        ok = _gate(pos_ptr, s_pb, s_pt, b, u, T, back, HAS_POS)
        rows = _rows(x_ptr, s_xb, s_xt, s_xc, b, u - back, c, OFF, L, cmask)
        share = tl.sum(tl.where(ok[:, None], gp * rows, 0.0), axis=0)
        dw += tl.where(taps[None, :] == tap, share[:, None], 0.0)
    off = (b * L + (u + OFF).to(tl.int64))[:, None] * C + c[None, :]
    tl.store(dx_ptr + off, d_in.to(dx_ptr.dtype.element_ty), mask=owned[:, None] & cmask[None, :])
    return dw, db


@triton.jit
def gdn_conv_bwd_kernel(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt,
                        dy_ptr, s_db, s_dt, s_dc, dx_ptr, dw_ptr, db_ptr, T, C, OFF, L, TILES,
                        K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr,
                        SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Program (i_s, i_c, b): TILES token tiles from i_s · TILES · BT (program 0 also the halo's
    OFF rows in front); its fp32 partial dw [BC, KP] and db [BC] go to row (b, i_s) of the partials."""
    i_s, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    c = i_c * BC + tl.arange(0, BC)
    cmask = c < C
    dw = tl.zeros((BC, KP), tl.float32)
    db = tl.zeros((BC,), tl.float32)
    if i_s == 0:  # the left context's OFF rows: their gradient only (their gp is zero)
        for i in range(tl.cdiv(OFF, BT)):
            dw, db = _bwd_tile(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, dy_ptr,
                               s_db, s_dt, s_dc, dx_ptr, b, i * BT - OFF, 0, c, cmask, T, C, OFF, L, dw, db, K, KP,
                               HAS_BIAS, HAS_POS, SILU, BT)
    for i in range(TILES):
        u0 = (i_s * TILES + i) * BT
        dw, db = _bwd_tile(x_ptr, s_xb, s_xt, s_xc, w_ptr, s_wc, s_wk, bias_ptr, pos_ptr, s_pb, s_pt, dy_ptr, s_db,
                           s_dt, s_dc, dx_ptr, b, u0, T, c, cmask, T, C, OFF, L, dw, db, K, KP, HAS_BIAS, HAS_POS,
                           SILU, BT)
    row = b * tl.num_programs(0) + i_s
    taps = tl.arange(0, KP)
    tl.store(dw_ptr + (row * C + c)[:, None] * KP + taps[None, :], dw, mask=cmask[:, None])
    tl.store(db_ptr + row * C + c, db, mask=cmask)


# ----------------------------------------------------------------------------- launchers


def _common(x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor | None, halo: bool):
    K = weight.shape[-1]
    B, L, C = x.shape
    off = K - 1 if halo else 0
    w2 = weight.reshape(C, K)
    pos, pos_strides = (positions, positions.stride()) if positions is not None else (x, (0, 0))  # x: unread
    args = (x, *x.stride(), w2, *w2.stride(), bias.contiguous() if bias is not None else w2, pos, *pos_strides)
    flags = {"K": K, "HAS_BIAS": bias is not None, "HAS_POS": positions is not None}
    return B, L - off, C, off, L, args, flags


def conv_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor | None, silu: bool,
             halo: bool) -> Tensor:
    """-> y [B, T, C] contiguous in x's dtype (see the module docstring)."""
    B, T, C, off, L, args, flags = _common(x, weight, bias, positions, halo)
    y = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    BT, BC = CONV_BT["fwd"], CONV_BC["fwd"]
    launching.launch(gdn_conv_fwd_kernel, (triton_cdiv(T, BT), triton_cdiv(C, BC), B), *args, y, T, C, off, L,
                     **flags, SILU=silu, BT=BT, BC=BC, num_warps=CONV_WARPS["fwd"])
    return y


def conv_bwd(dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor | None, silu: bool,
             halo: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """-> (dx like x's shape, contiguous, in x's dtype; dw [C, 1, K] and db [C] summed in fp32, in
    weight's and bias' dtypes; db None without a bias)."""
    B, T, C, off, L, args, flags = _common(x, weight, bias, positions, halo)
    BT, BC = CONV_BT["bwd"], CONV_BC["bwd"]
    c_blocks, t_tiles = triton_cdiv(C, BC), triton_cdiv(T, BT)
    tiles = max(1, triton_cdiv(t_tiles * B * c_blocks, BWD_TARGET_PROGRAMS))
    splits = triton_cdiv(t_tiles, tiles)
    KP = triton.next_power_of_2(flags["K"])
    dx = torch.empty(B, L, C, device=x.device, dtype=x.dtype)
    dw = torch.empty(B * splits, C, KP, device=x.device, dtype=torch.float32)
    db = torch.empty(B * splits, C, device=x.device, dtype=torch.float32)
    launching.launch(gdn_conv_bwd_kernel, (splits, c_blocks, B), *args, dy, *dy.stride(), dx, dw, db, T, C, off,
                     L, tiles, **flags, KP=KP, SILU=silu, BT=BT, BC=BC, num_warps=CONV_WARPS["bwd"])
    dw = dw.sum(0)[:, :flags["K"]].reshape(weight.shape).to(weight.dtype)
    return dx, dw, db.sum(0).to(bias.dtype) if bias is not None else None
