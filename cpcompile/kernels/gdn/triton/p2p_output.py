"""State-P2P forward, the output: a segment's output from its incoming state and the summary's
stored entering states ``[P | h0]`` of every ``HS``-th chunk (``gdn_p2p_output_kernel``, launcher
``p2p_output``), and ``p2p_hstride``, the group length the summary (``p2p_summary.py``) and the
output must share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ....errors import CPInputError
from ..common import CHUNK_SIZE
from . import launching
from .helpers import _chunk_gates, _mat_ptr, _mm, _tok_load, _tok_store
from .launching import NUM_WARPS, stages, triton_cdiv
from .output import _chunk_output


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


# ----------------------------------------------------------------------------- launcher


# State-P2P: chunks per stored summary state (= per group of the summary's identity programs; the
# output steps the state through the others) and the output's value block. BV = V was slower than 64
# at 4 or 8 warps; BV = 32 hit an illegal address at 4 warps and gave wrong outputs at 8 (one stage,
# Triton 3.6 on an H200; the interpreter gives the right result), so keep it >= 64 at K = 128.
# P2P_HSTRIDE None: ``p2p_hstride`` picks the stride per call; an int fixes it (tests, benchmarks).
P2P_HSTRIDE: int | None = None
# The output kernel fits two programs per SM (registers); its grid is (V/BV * groups, B*Hv).
P2P_OUTPUT_PROGRAMS_PER_SM = 2
P2P_HSTRIDE_RANGE = (16, 256)
P2P_OUTPUT_BV = 64


def _p2p_output_bv(V: int, dtype: torch.dtype) -> int:
    """fp32 tiles take twice the shared memory of bf16 ones: keep them at most 64 columns wide."""
    return min(P2P_OUTPUT_BV, V, 64 if dtype == torch.float32 else V)


def p2p_hstride(B: int, Hv: int, V: int, NT: int, dtype: torch.dtype, device: torch.device) -> int:
    """Chunks per State-P2P group: as many groups as give the output kernel one full wave (two
    programs per SM), each group as long as that allows (fewer stored states, a shorter chain).
    H200, 16 key / 32 value heads, K = V = 128 bf16, full forward against HS fixed at 16..256
    (results/gdn_p2p_output_variants_2026-12-01_NVIDIA-H200.md): the rule's pick (4 groups at
    these shapes) was the fastest or within 1% at 4K..64K; 2 groups lost at every T (a half-empty
    wave), 16 chunks at 64K cost 6% more. Summary and output must agree (``p2p_output`` checks);
    both call this with the same shapes."""
    if P2P_HSTRIDE is not None:
        return P2P_HSTRIDE
    lo, hi = P2P_HSTRIDE_RANGE
    if device.type != "cuda":  # the CPU interpreter: no SMs to fill
        return lo
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_group = B * Hv * (V // _p2p_output_bv(V, dtype))
    groups = max(1, round(P2P_OUTPUT_PROGRAMS_PER_SM * sms / per_group))
    return min(max(triton.next_power_of_2(triton_cdiv(NT, groups)), lo), hi)


def p2p_output(q: Tensor, k: Tensor, w: Tensor, u: Tensor, gc: Tensor, hbuf: Tensor, h_in: Tensor,
               scale: float, hstride: int | None = None) -> Tensor:
    """Output from the summary's states ``hbuf`` (``[P | h0]`` of every ``p2p_hstride``-th
    chunk, or every ``hstride``-th: the summary's), prepare's ``w``, ``u`` and the incoming state
    ``h_in`` fp32 [B,Hv,K,V]."""
    B, T, Hk, K = q.shape
    Hv, V = u.shape[2], u.shape[3]
    NT = triton_cdiv(T, CHUNK_SIZE)
    HS = hstride or p2p_hstride(B, Hv, V, NT, q.dtype, q.device)
    if hbuf.shape[1] != triton_cdiv(NT, HS):
        raise CPInputError(f"GDN State-P2P: the summary stored {hbuf.shape[1]} states for {NT} chunks, but "
                         f"the output's stride is {HS} chunks: summary and output must run with the same setting")
    BV = _p2p_output_bv(V, q.dtype)
    o = torch.empty(B, T, Hv, V, device=q.device, dtype=q.dtype)
    launching.launch(gdn_p2p_output_kernel, (V // BV * triton_cdiv(NT, HS), B * Hv),
        q, k, w, u, gc, hbuf, h_in, o, scale, T, NT, Hk=Hk, Hv=Hv, K=K, V=V, HS=HS, BT=CHUNK_SIZE, BV=BV,
        num_warps=NUM_WARPS["p2p_output"], num_stages=stages("p2p_output", q.dtype), **launching.flags(q.dtype))
    return o
