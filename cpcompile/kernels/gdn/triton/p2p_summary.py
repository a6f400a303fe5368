"""State-P2P forward, the summary: a segment's affine summary ``H_out = M H_in + S`` before ``H_in``
is known. ``S`` and the zero-state entering states ``h0_c`` come from a state pass from zero; ``M``
is the product of the chunk transitions: identity columns that start as ``I`` and receive no value
input hold, at every chunk, the product ``P_c`` of the transitions so far. Given ``H_in``, chunk c's
true entering state is ``h0_c + P_c H_in``, and its updates follow from prepare's ``u``, ``w``.

``gdn_p2p_summary_kernel`` (launcher ``p2p_summary_pass``): the value columns run from zero over
all chunks, one long program per column block and head; the identity columns run per group of
``HS`` chunks, each from ``I``, in many short programs that fill the SMs the long ones leave idle.
``gdn_p2p_chain_kernel`` (launcher ``p2p_chain``) then multiplies the group transitions into ``P``
at every group start and ``M``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import CHUNK_SIZE
from . import launching
from .helpers import _mat_ptr, _mm
from .launching import NUM_STAGES, NUM_WARPS, dims, stages, state_bv, triton_cdiv
from .p2p_output import p2p_hstride
from .state import _fwd_state_loop


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


# ----------------------------------------------------------------------------- launcher


# the forward summary's identity-column block (one program per block, group (``p2p_hstride``) and head)
P2P_IDENTITY_BV = 64
# the chain's column block of P (one program per block and head, sequential over the groups). H200,
# 8 warps, next G prefetched: 32 took 0.063 / 0.159 ms at 16K / 64K, 64 0.064 / 0.186, 128 0.088 / 0.260
# (results/gdn_p2p_output_variants_2026-12-01_NVIDIA-H200.md)
P2P_CHAIN_BV = 32


def p2p_summary_pass(k: Tensor, w: Tensor, u: Tensor, gc: Tensor, hstride: int | None = None):
    """The zero-state pass and the group transitions of a State-P2P summary (``gdn_p2p_summary_kernel``)
    -> (hbuf [B,NG,Hv,K,K+V] with ``h0`` of every ``p2p_hstride``-th chunk in ``[..., K:]``, ht fp32
    [B,Hv,K,K+V] with ``S`` in ``[..., K:]``, gbuf fp32 [B,NG,Hv,K,K] the group transitions);
    ``p2p_chain`` fills the identity parts. ``hstride`` overrides ``p2p_hstride`` (for a caller that
    runs the output on some rows at a time: both must use one stride)."""
    B, T, Hk, Hv, K, V, NT = dims(k, u)
    HS = hstride or p2p_hstride(B, Hv, V, NT, k.dtype, k.device)
    NG = triton_cdiv(NT, HS)
    BV, BVI = state_bv("p2p_summary", K, V), min(P2P_IDENTITY_BV, K)
    hbuf = torch.empty(B, NG, Hv, K, K + V, device=k.device, dtype=k.dtype)
    ht = torch.empty(B, Hv, K, K + V, device=k.device, dtype=torch.float32)
    gbuf = torch.empty(B, NG, Hv, K, K, device=k.device, dtype=torch.float32)
    programs = B * Hv * (V // BV + NG * (K // BVI))
    launching.launch(gdn_p2p_summary_kernel, (programs,),
        k, w, u, gc, hbuf, ht, gbuf, T, NT, B * Hv, Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BV=BV, BVI=BVI, HS=HS,
        num_warps=NUM_WARPS["p2p_summary"], num_stages=stages("p2p_summary", k.dtype), **launching.flags(k.dtype))
    return hbuf, ht, gbuf


def p2p_chain(gbuf: Tensor, hbuf: Tensor, ht: Tensor) -> None:
    """Fills ``hbuf[..., :K]`` with the product ``P`` of the transitions before every group and
    ``ht[..., :K]`` with ``M`` (``gdn_p2p_chain_kernel``), in place."""
    B, NG, Hv, K, _ = gbuf.shape
    BVC = min(P2P_CHAIN_BV, K)
    launching.launch(gdn_p2p_chain_kernel, (K // BVC, B * Hv),
        gbuf, hbuf, ht, NG, Hv=Hv, K=K, V=hbuf.shape[-1] - K, BVC=BVC,
        num_warps=NUM_WARPS["p2p_chain"], num_stages=NUM_STAGES["p2p_chain"], **launching.flags(hbuf.dtype))
