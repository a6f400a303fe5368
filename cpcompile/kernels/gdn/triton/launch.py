"""Launch wrappers: allocate outputs, pick block sizes, launch one kernel each.

Plain local GDN:   ``gdn_fwd`` / ``gdn_bwd``.
State-P2P pieces:  ``p2p_fwd_summary`` -> serial ``M @ H + S`` -> ``p2p_fwd_output``;
                   ``p2p_bwd_summary`` -> serial ``dH_local + M^T dH`` -> ``p2p_bwd_finish``.
All tensors are contiguous ``[B, T, H, D]`` token tensors, fp32 states ``[B, Hv, K, V]``.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from ....errors import CPInputError
from ..common import CHUNK_SIZE, L2NORM_EPS
from . import kernels as _k

# num_warps / num_stages per kernel (tuned on an H200, see benchmarks/); benchmarks may override.
NUM_WARPS = {"prepare": 4, "state": 8, "state_aug": 4, "output": 4, "p2p_output": 4, "dv_local": 4, "bwd_state": 4,
             "inter": 8, "bwd_wy": 8, "bwd_tri": 4}
NUM_STAGES = {"state": 3, "state_aug": 3, "bwd_state": 3, "inter": 3, "p2p_output": 1}


def _stages(name: str, dtype: torch.dtype, wide: bool = False) -> int:
    """Software-pipelining depth of a kernel's loop. fp32 tiles (and the augmented bwd_inter, which
    holds two extra K-wide tiles) overflow Hopper's 227 KiB of shared memory when multi-buffered."""
    return 1 if (dtype == torch.float32 or wide) else NUM_STAGES[name]


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _flags(dtype: torch.dtype) -> dict:
    """PREC: precision of fp32 dots on tensor cores (tf32x3 keeps fp32 inputs fp32-accurate);
    UPCAST: the CPU interpreter's bf16 dot is unreliable, so upcast there."""
    return {"PREC": "tf32x3" if dtype == torch.float32 else "tf32", "UPCAST": _interpret()}


def _dims(q: Tensor | None, k: Tensor, v: Tensor):
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    return B, T, Hk, Hv, K, V, triton_cdiv(T, CHUNK_SIZE)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# value-column block of the chunk-sequential state passes (more blocks = more CTAs in flight);
# the augmented (K+V wide) passes already have twice the blocks. Tuned on an H200 at T=16K.
STATE_BV = 32
STATE_BV_AUG = 64
# value-column block of the plain output kernel
OUTPUT_BV = 64
# State-P2P: chunks per stored summary state (the output steps the state through the others) and
# the output's value block. H200, K=V=128 bf16, T=4K..64K (benchmarks/gdn_kernels.py --p2p-variants):
# HS 16 was best or within 2% (fewer stored states in the summary, fewer K x K state dots in the
# output; 32 lost at 4K: too few groups); BV = V was slower than 64 at 4 or 8 warps; BV = 32 hit an
# illegal address there (Triton 3.6, not understood: the interpreter gives the right result), so keep
# it >= 64 at K = 128. Summary and output must run with the same P2P_HSTRIDE (``p2p_fwd_output`` checks).
P2P_HSTRIDE = 16
P2P_OUTPUT_BV = 64


def _bv(K: int, V: int) -> int:
    return min(64, K, V)


def _output_bv(V: int) -> int:
    return min(OUTPUT_BV, V)


def _p2p_output_bv(V: int, dtype: torch.dtype) -> int:
    """fp32 tiles take twice the shared memory of bf16 ones: keep them at most 64 columns wide."""
    return min(P2P_OUTPUT_BV, V, 64 if dtype == torch.float32 else V)


def _state_bv(K: int, V: int, augmented: bool = False) -> int:
    return min(STATE_BV_AUG if augmented else STATE_BV, K, V)


# ----------------------------------------------------------------------------- forward pieces


def fwd_prepare(k: Tensor, v: Tensor, g: Tensor, beta: Tensor):
    """-> (gc fp32 [B,T,Hv], w [B,T,Hv,K], u [B,T,Hv,V] in k's dtype, tinv fp32 [B,T,Hv,64])."""
    B, T, Hk, Hv, K, V, NT = _dims(None, k, v)
    gc = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    w = torch.empty(B, T, Hv, K, device=k.device, dtype=k.dtype)
    u = torch.empty(B, T, Hv, V, device=k.device, dtype=k.dtype)
    tinv = torch.empty(B, T, Hv, CHUNK_SIZE, device=k.device, dtype=torch.float32)
    _k.gdn_fwd_prepare_kernel[(NT, B * Hv)](
        k, v, g, beta, gc, w, u, tinv, T, Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, LOG2_BT=int(math.log2(CHUNK_SIZE)),
        num_warps=NUM_WARPS["prepare"], **_flags(k.dtype))
    return gc, w, u, tinv


def fwd_state(k: Tensor, w: Tensor, u: Tensor, gc: Tensor, h0: Tensor | None, nx: int = 0,
              hstride: int = 1, store_vn: bool = True):
    """Chunk-sequential state pass. ``nx = K`` runs the augmented (summary) pass from a zero state.

    -> (hbuf [B,cdiv(NT,hstride),Hv,K,nx+V] entering states of every ``hstride``-th chunk,
    vnbuf [B,T,Hv,nx+V] updates (None unless ``store_vn``), ht fp32 [B,Hv,K,nx+V]).
    """
    B, T, Hk, Hv, K, V, NT = _dims(None, k, u)
    NS = nx + V
    BV, key = _state_bv(K, V, nx > 0), "state_aug" if nx else "state"
    hbuf = torch.empty(B, triton_cdiv(NT, hstride), Hv, K, NS, device=k.device, dtype=k.dtype)
    vnbuf = torch.empty(B, T, Hv, NS, device=k.device, dtype=k.dtype) if store_vn else None
    ht = torch.empty(B, Hv, K, NS, device=k.device, dtype=torch.float32)
    _k.gdn_fwd_state_kernel[(NS // BV, B * Hv)](
        k, w, u, gc, h0 if h0 is not None else ht, hbuf, vnbuf if store_vn else hbuf, ht, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, NX=nx, BT=CHUNK_SIZE, BV=BV, HS=hstride, STORE_VN=store_vn, USE_H0=h0 is not None,
        num_warps=NUM_WARPS[key], num_stages=_stages(key, k.dtype), **_flags(k.dtype))
    return hbuf, vnbuf, ht


def fwd_output(q: Tensor, k: Tensor, gc: Tensor, hbuf: Tensor, vnbuf: Tensor, scale: float) -> Tensor:
    """Output from a plain state pass's per-chunk entering states and updates."""
    B, T, Hk, K = q.shape
    Hv, V = gc.shape[2], vnbuf.shape[-1]
    NT, BV = triton_cdiv(T, CHUNK_SIZE), _output_bv(V)
    o = torch.empty(B, T, Hv, V, device=q.device, dtype=q.dtype)
    _k.gdn_fwd_output_kernel[(V // BV, NT, B * Hv)](
        q, k, gc, hbuf, vnbuf, o, scale, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BV=BV, num_warps=NUM_WARPS["output"], **_flags(q.dtype))
    return o


def p2p_output(q: Tensor, k: Tensor, w: Tensor, u: Tensor, gc: Tensor, hbuf: Tensor, h_in: Tensor,
               scale: float) -> Tensor:
    """Output from the augmented summary's states ``hbuf`` (``[P | h0]`` of every ``P2P_HSTRIDE``-th
    chunk), prepare's ``w``, ``u`` and the incoming state ``h_in`` fp32 [B,Hv,K,V]."""
    B, T, Hk, K = q.shape
    Hv, V = u.shape[2], u.shape[3]
    NT, HS = triton_cdiv(T, CHUNK_SIZE), P2P_HSTRIDE
    if hbuf.shape[1] != triton_cdiv(NT, HS):
        raise CPInputError(f"GDN State-P2P: the summary stored {hbuf.shape[1]} states for {NT} chunks, but "
                         f"P2P_HSTRIDE is {HS}: summary and output must run with the same setting")
    BV = _p2p_output_bv(V, q.dtype)
    o = torch.empty(B, T, Hv, V, device=q.device, dtype=q.dtype)
    _k.gdn_p2p_output_kernel[(V // BV, triton_cdiv(NT, HS), B * Hv)](
        q, k, w, u, gc, hbuf, h_in, o, scale, T, NT, Hk=Hk, Hv=Hv, K=K, V=V, HS=HS, BT=CHUNK_SIZE, BV=BV,
        num_warps=NUM_WARPS["p2p_output"], num_stages=_stages("p2p_output", q.dtype), **_flags(q.dtype))
    return o


def gdn_fwd(q, k, v, g, beta, h0, scale):
    """Plain local forward -> (o, final state fp32, gc, w, u, tinv); the last four are saved for backward."""
    h0 = h0.float().contiguous() if h0 is not None else None
    gc, w, u, tinv = fwd_prepare(k, v, g, beta)
    hbuf, vnbuf, ht = fwd_state(k, w, u, gc, h0)
    o = fwd_output(q, k, gc, hbuf, vnbuf, scale)
    return o, ht, gc, w, u, tinv


# ----------------------------------------------------------------------------- backward pieces


def bwd_dv_local(q, k, gc, do, scale):
    B, T, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    dvl = torch.empty(B, T, Hv, V, device=q.device, dtype=torch.float32)
    _k.gdn_bwd_dv_local_kernel[(triton_cdiv(T, CHUNK_SIZE), B * Hv)](
        q, k, gc, do, dvl, scale, T, Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE,
        num_warps=NUM_WARPS["dv_local"], **_flags(q.dtype))
    return dvl


def bwd_state(q, k, w, gc, do, dvl, dht, scale, ny: int = 0):
    """Reverse state pass -> (dhbuf [B,NT,Hv,K,ny+V] grads of leaving states, dvnbuf fp32 [B,T,Hv,ny+V],
    dh0 fp32 [B,Hv,K,ny+V]). ``ny = K`` carries the transposed suffix products beside them."""
    B, T, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    NT, NS, BV = triton_cdiv(T, CHUNK_SIZE), ny + V, _state_bv(K, V, ny > 0)
    dhbuf = torch.empty(B, NT, Hv, K, NS, device=q.device, dtype=q.dtype)
    dvnbuf = torch.empty(B, T, Hv, NS, device=q.device, dtype=torch.float32)
    dh0 = torch.empty(B, Hv, K, NS, device=q.device, dtype=torch.float32)
    _k.gdn_bwd_state_kernel[(NS // BV, B * Hv)](
        q, k, w, gc, do, dvl, dht if dht is not None else dh0, dhbuf, dvnbuf, dh0, scale, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, NX=ny, BT=CHUNK_SIZE, BV=BV, USE_DHT=dht is not None,
        num_warps=NUM_WARPS["bwd_state"], num_stages=_stages("bwd_state", q.dtype), **_flags(q.dtype))
    return dhbuf, dvnbuf, dh0


def bwd_inter(q, k, gc, do, hbuf, vnbuf, dhbuf, dvnbuf, scale, dh_out: Tensor | None = None, ny: int = 0):
    B, T, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    NT, BV = triton_cdiv(T, CHUNK_SIZE), _bv(K, V)
    f32 = dict(device=q.device, dtype=torch.float32)
    dq = torch.empty(B, T, Hv, K, **f32)
    dk = torch.empty(B, T, Hv, K, **f32)
    dw = torch.empty(B, T, Hv, K, **f32)
    dgc = torch.empty(B, T, Hv, **f32)
    du = torch.empty(B, T, Hv, V, **f32) if ny else None
    _k.gdn_bwd_inter_kernel[(NT, B * Hv)](
        q, k, gc, do, hbuf, vnbuf, dhbuf, dvnbuf, dh_out if dh_out is not None else dq, du if du is not None else dq,
        dq, dk, dw, dgc, scale, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, NSH=vnbuf.shape[-1], NY=ny, BT=CHUNK_SIZE, BV=BV,
        num_warps=NUM_WARPS["inter"], num_stages=_stages("inter", q.dtype, wide=ny > 0), **_flags(q.dtype))
    return dq, dk, dw, dgc, du


def bwd_prepare(k, v, beta, gc, tinv, dw, du, du_off, dk, dgc):
    """-> (dk per value head fp32, dv, dbeta fp32, dg fp32); ``dk``/``dgc`` are updated in place.
    ``du`` rows may be wider than V (read from column ``du_off``)."""
    B, T, Hk, Hv, K, V, NT = _dims(None, k, v)
    dv = torch.empty(B, T, Hv, V, device=k.device, dtype=v.dtype)
    dbeta = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    dg = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    dT = torch.empty(B, T, Hv, CHUNK_SIZE, device=k.device, dtype=torch.float32)
    _k.gdn_bwd_wy_kernel[(NT, B * Hv)](
        k, v, beta, gc, tinv, dw, du, dk, dgc, dT, dv, dbeta, T, du.shape[-1], du_off,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, num_warps=NUM_WARPS["bwd_wy"], **_flags(k.dtype))
    _k.gdn_bwd_tri_kernel[(NT, B * Hv)](
        k, beta, gc, tinv, dT, dk, dgc, dbeta, dg, T,
        Hk=Hk, Hv=Hv, K=K, BT=CHUNK_SIZE, num_warps=NUM_WARPS["bwd_tri"], **_flags(k.dtype))
    return dk, dv, dbeta, dg


def _sum_groups(x: Tensor, Hk: int) -> Tensor:
    """[B,T,Hv,D] per-value-head grads -> [B,T,Hk,D]: value head h feeds key head h // (Hv // Hk)."""
    B, T, Hv, D = x.shape
    return x.view(B, T, Hk, Hv // Hk, D).sum(3) if Hv != Hk else x


def _finish(q, k, v, g, beta, dq, dk, dv, dbeta, dg, qk_grad_dtype=None):
    Hk = k.shape[2]
    return (_sum_groups(dq, Hk).to(qk_grad_dtype or q.dtype), _sum_groups(dk, Hk).to(qk_grad_dtype or k.dtype), dv,
            dg.to(g.dtype), dbeta.to(beta.dtype))


def gdn_bwd(q, k, v, g, beta, h0, gc, w, u, tinv, do, dht, scale, qk_grad_dtype=None):
    """Plain local backward -> (dq, dk, dv, dg, dbeta, dh0 fp32). Recomputes the chunk states.
    ``qk_grad_dtype``: dtype of dq, dk (default q's / k's; the layer ops ask for the dtype q and k had
    before their cast to the kernel dtype, so fp32 gradients are not rounded through bf16)."""
    h0 = h0.float().contiguous() if h0 is not None else None
    dht = dht.float().contiguous() if dht is not None else None
    do = do.contiguous()
    hbuf, vnbuf, _ = fwd_state(k, w, u, gc, h0)
    dvl = bwd_dv_local(q, k, gc, do, scale)
    dhbuf, dvnbuf, dh0 = bwd_state(q, k, w, gc, do, dvl, dht, scale)
    dq, dk, dw, dgc, _ = bwd_inter(q, k, gc, do, hbuf, vnbuf, dhbuf, dvnbuf, scale)
    dk, dv, dbeta, dg = bwd_prepare(k, v, beta, gc, tinv, dw, dvnbuf, 0, dk, dgc)
    return (*_finish(q, k, v, g, beta, dq, dk, dv, dbeta, dg, qk_grad_dtype), dh0)


# ----------------------------------------------------------------------------- State-P2P pieces


def p2p_fwd_summary(k, v, g, beta):
    """Everything of a rank's forward that does not need the incoming state, plus its summary.

    -> (M fp32 [B,Hv,K,K], S fp32 [B,Hv,K,V], saved = (gc, w, u, tinv, hbuf)) where
    ``H_out = M @ H_in + S``. One augmented state pass (width K + V) replaces the plain one; it
    stores only the entering states ``[P | h0]`` of every ``P2P_HSTRIDE``-th chunk: the output
    rebuilds the updates from ``w`` and ``u``, which the backward keeps anyway.
    """
    K = k.shape[-1]
    gc, w, u, tinv = fwd_prepare(k, v, g, beta)
    hbuf, _, ht = fwd_state(k, w, u, gc, None, nx=K, hstride=P2P_HSTRIDE, store_vn=False)
    M, S = ht[..., :K], ht[..., K:]
    return M, S, (gc, w, u, tinv, hbuf)


def p2p_fwd_output(q, k, saved, h_in: Tensor, scale: float) -> Tensor:
    """Output of the rank given its incoming state ``h_in`` (fp32 [B,Hv,K,V])."""
    gc, w, u, _, hbuf = saved
    return p2p_output(q, k, w, u, gc, hbuf, h_in.float().contiguous(), scale)


def p2p_bwd_summary(q, k, w, gc, do, scale):
    """Gradient of the rank's loss w.r.t. its incoming state through its own outputs (``dH_local``,
    fp32 [B,Hv,K,V]) plus ``M^T`` from the same pass, and what ``p2p_bwd_finish`` needs. The serial
    chain then only does ``dH_in = dH_local + M^T dH_out``."""
    K = k.shape[-1]
    dvl = bwd_dv_local(q, k, gc, do, scale)
    dhbuf, dvnbuf, dh0 = bwd_state(q, k, w, gc, do, dvl, None, scale, ny=K)
    return dh0[..., K:], dh0[..., :K], (dhbuf, dvnbuf)


def p2p_bwd_finish(q, k, v, g, beta, gc, w, u, tinv, do, h_in, dsaved, dh_out, scale, qk_grad_dtype=None):
    """Input gradients of the rank once its incoming state ``h_in`` and the gradient of its leaving
    state ``dh_out`` are known -> (dq, dk, dv, dg, dbeta); ``qk_grad_dtype`` as in ``gdn_bwd``."""
    K = k.shape[-1]
    dhbuf, dvnbuf = dsaved
    h_in = h_in.float().contiguous() if h_in is not None else None
    dh_out = dh_out.float().contiguous() if dh_out is not None else dhbuf.new_zeros(*dhbuf.shape[:1], *dhbuf.shape[2:4], v.shape[-1], dtype=torch.float32)
    hbuf, vnbuf, _ = fwd_state(k, w, u, gc, h_in)
    dq, dk, dw, dgc, du = bwd_inter(q, k, gc, do, hbuf, vnbuf, dhbuf, dvnbuf, scale, dh_out=dh_out, ny=K)
    dk, dv, dbeta, dg = bwd_prepare(k, v, beta, gc, tinv, dw, du, 0, dk, dgc)
    return _finish(q, k, v, g, beta, dq, dk, dv, dbeta, dg, qk_grad_dtype)


# ----------------------------------------------------------------------------- q/k L2 norm

L2NORM_ROWS = 32


def l2norm_fwd(x: Tensor, eps: float = L2NORM_EPS):
    """-> (x / sqrt(sum(x^2) + eps) in x's dtype, rstd fp32 [...]) over the last dim."""
    D = x.shape[-1]
    N = x.numel() // D
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    _k.gdn_l2norm_fwd_kernel[(triton_cdiv(N, L2NORM_ROWS),)](x, y, rstd, N, eps, D=D, BR=L2NORM_ROWS, num_warps=4)
    return y, rstd


def l2norm_bwd(x: Tensor, rstd: Tensor, dy: Tensor) -> Tensor:
    D = x.shape[-1]
    N = x.numel() // D
    dx = torch.empty_like(x)
    _k.gdn_l2norm_bwd_kernel[(triton_cdiv(N, L2NORM_ROWS),)](x, rstd, dy, dx, N, D=D, BR=L2NORM_ROWS, num_warps=4)
    return dx
