"""Launch wrappers: allocate outputs, pick block sizes, launch one kernel each.

Plain local GDN:   ``gdn_fwd`` / ``gdn_bwd``.
State-P2P pieces:  ``p2p_fwd_summary`` -> serial ``M @ H + S`` -> ``p2p_fwd_output``;
                   ``p2p_bwd_summary`` -> serial ``dH_local + M^T dH`` -> ``p2p_bwd_finish`` (a plain
                   backward from ``H_in`` and ``dH``).
All tensors are contiguous ``[B, T, H, D]`` token tensors, fp32 states ``[B, Hv, K, V]``.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
from torch import Tensor
from triton.runtime.errors import OutOfResources

from ....errors import CPInputError, GDNCapabilityError
from ..common import CHUNK_SIZE, L2NORM_EPS
from . import kernels as _k

# num_warps / num_stages per kernel; benchmarks may override. "bwd_state_aug" is State-P2P's augmented
# (K + V wide) reverse pass, "p2p_summary" / "p2p_chain" its forward summary. Tuned on an H200 at T=16K
# (`benchmarks/gdn_kernels.py --tune`, results/gdn_kernels_2026-12-01_NVIDIA-H200.md): the plain state pass
# 4 warps (0.565 ms, 8: 0.584), the prepare backward 4 (8 spilled: 1.395 vs 1.198), the plain output 4
# (0.234 ms, 2: 0.307, 8: 0.431; results/gdn_kernels_2026-12-01_NVIDIA-H200_output-warps.md). The augmented
# backward pass, since it keeps nothing per chunk, 4 (State-P2P's backward summary 0.758 / 2.911 ms at
# 16K / 64K, 8: 0.837 / 3.250; `--p2p-variants`, results/gdn_p2p_segments_2026-12-01_NVIDIA-H200.md). The
# forward summary 4 warps / value block 64 (0.438 ms at 16K; 8 warps 0.540, value block 32 0.472;
# results/gdn_p2p_split_summary_2026-12-01_NVIDIA-H200.md) / 4 stages: with the per-call group length
# (4 groups) 0.333 against 0.388 ms at 3 stages at 16K, 1.127 against 1.334 at 64K; 5 stages and an
# identity block of 128 were slower, 6 stages overflow the shared memory
# (results/gdn_p2p_summary_stages_2026-12-01_NVIDIA-H200.md). Its chain keeps a K x K fp32 tile, so one stage.
NUM_WARPS = {"prepare": 4, "state": 4, "p2p_summary": 4, "p2p_chain": 8, "output": 4, "p2p_output": 4,
             "dv_local": 2, "bwd_state": 4, "bwd_state_aug": 4, "inter": 8, "bwd_wy": 4}
NUM_STAGES = {"state": 3, "p2p_summary": 4, "p2p_chain": 1, "bwd_state": 3, "bwd_state_aug": 3, "inter": 3,
              "p2p_output": 1}

def _stages(name: str, dtype: torch.dtype) -> int:
    """Software-pipelining depth of a kernel's loop. fp32 tiles overflow Hopper's 227 KiB of shared
    memory when multi-buffered."""
    return 1 if dtype == torch.float32 else NUM_STAGES[name]


# (kernel, device, tuned stages, launch options) -> the deepest pipeline that fit that GPU's shared memory,
# only for launches that had to step down (empty on the GPU the depths were tuned on)
_FITTED_STAGES: dict[tuple, int] = {}
# False: a depth that does not fit raises instead (a tuning sweep must time the depth it names)
FIT_STAGES = True


def _launch(kernel, grid, *args, **options) -> None:
    """``kernel[grid](*args, **options)`` at its tuned pipeline depth (``num_stages``, default Triton's
    3), or at the deepest that fits this GPU's shared memory. The depths are tuned on an H200 (227 KiB
    per SM); a GPU with less (an A100 has 163 KiB) could not build some of them. Stages only schedule
    the loop's loads, so every depth computes the same result: a step down warns once, as it is
    slower than tuned. A kernel that does not fit even unpipelined raises ``GDNCapabilityError``."""
    tuned = stages = options.pop("num_stages", 3)
    key = None
    if _FITTED_STAGES:  # the hot path builds no key until some launch has stepped down
        key = _fit_key(kernel, tuned, options)
        stages = _FITTED_STAGES.get(key, tuned)
    while True:
        try:
            kernel[grid](*args, num_stages=stages, **options)
            break
        except OutOfResources as exc:
            if exc.name != "shared memory" or stages == 1 or not FIT_STAGES:
                raise GDNCapabilityError(exc.name, f"{kernel.fn.__name__} needs {exc.required} at {stages} "
                                         f"pipeline stage(s); this GPU has {exc.limit}") from exc
            stages -= 1
    if stages == tuned:
        return
    key = key or _fit_key(kernel, tuned, options)
    if key not in _FITTED_STAGES:
        warnings.warn(f"GDN triton: {kernel.fn.__name__} does not fit this GPU's shared memory at its tuned "
                      f"{tuned} pipeline stages; running it at {stages} (same results, slower than tuned)",
                      RuntimeWarning, stacklevel=3)
        _FITTED_STAGES[key] = stages


def _fit_key(kernel, tuned: int, options: dict) -> tuple:
    """A launch's identity for ``_FITTED_STAGES``: its shared memory depends on all of these."""
    device = torch.cuda.current_device() if not _interpret() and torch.cuda.is_available() else -1
    return (kernel.fn.__name__, device, tuned, tuple(options.items()))


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _flags(dtype: torch.dtype) -> dict:
    """PREC: precision of fp32 dots on tensor cores (tf32x3 keeps fp32 inputs fp32-accurate);
    UPCAST: the CPU interpreter's bf16 dot is unreliable, so upcast there."""
    return {"PREC": "tf32x3" if dtype == torch.float32 else "tf32", "UPCAST": _interpret()}


def _dims(k: Tensor, v: Tensor):
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    return B, T, Hk, Hv, K, V, triton_cdiv(T, CHUNK_SIZE)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# value-column block of the chunk-sequential state passes (more blocks = more CTAs in flight);
# the augmented (K+V wide) backward pass already has twice the blocks, and the forward summary's value
# programs share the SMs with its identity programs. Tuned on an H200 at T=16K.
STATE_BV = {"state": 32, "p2p_summary": 64, "bwd_state": 32, "bwd_state_aug": 64}
# the forward summary's identity-column block (one program per block, group (``p2p_hstride``) and head)
P2P_IDENTITY_BV = 64
# the chain's column block of P (one program per block and head, sequential over the groups). H200,
# 8 warps, next G prefetched: 32 took 0.063 / 0.159 ms at 16K / 64K, 64 0.064 / 0.186, 128 0.088 / 0.260
# (results/gdn_p2p_output_variants_2026-12-01_NVIDIA-H200.md)
P2P_CHAIN_BV = 32
# prepare's chunk inverse: 1 is recursive doubling on the tensor cores alone (12 dots); BS > 1 inverts
# BS-row diagonal blocks by forward substitution (on the CUDA cores, BS - 1 steps) before its blocked
# steps (CHUNK_SIZE / BS - 1 of them). Both stable (tests/kernels/test_gdn_stress.py); on an H200 at
# 16K tokens prepare took 0.443 ms with 1, 0.455 with 8, 0.562 with 16
# (results/gdn_kernels_2026-12-02_NVIDIA-H200_blocked-inverse.md)
INVERSE_BLOCK = 1
# value-column block of the plain output kernel
OUTPUT_BV = 64
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


def _bv(K: int, V: int) -> int:
    return min(64, K, V)


def _output_bv(V: int) -> int:
    return min(OUTPUT_BV, V)


def _p2p_output_bv(V: int, dtype: torch.dtype) -> int:
    """fp32 tiles take twice the shared memory of bf16 ones: keep them at most 64 columns wide."""
    return min(P2P_OUTPUT_BV, V, 64 if dtype == torch.float32 else V)


def _state_bv(key: str, K: int, V: int) -> int:
    return min(STATE_BV[key], K, V)


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


# ----------------------------------------------------------------------------- forward pieces


def fwd_prepare(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, store_tinv: bool = True):
    """-> (gc fp32 [B,T,Hv], w [B,T,Hv,K], u [B,T,Hv,V] in k's dtype, tinv fp32 [B,T,Hv,64]).

    Only the backward reads ``tinv``: a forward whose caller recomputes prepare for its backward
    passes ``store_tinv=False`` (tinv is then None), which spares an fp32 ``[B,T,Hv,64]`` write."""
    B, T, Hk, Hv, K, V, NT = _dims(k, v)
    gc = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    w = torch.empty(B, T, Hv, K, device=k.device, dtype=k.dtype)
    u = torch.empty(B, T, Hv, V, device=k.device, dtype=k.dtype)
    tinv = torch.empty(B, T, Hv, CHUNK_SIZE, device=k.device, dtype=torch.float32) if store_tinv else None
    # without tinv the kernel gets gc as its tinv pointer, which STORE_TINV=False never writes
    _launch(_k.gdn_fwd_prepare_kernel, (NT, B * Hv),
        k, v, g, beta, gc, w, u, tinv if store_tinv else gc, T, Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE,
        BS=INVERSE_BLOCK, STORE_TINV=store_tinv, num_warps=NUM_WARPS["prepare"], **_flags(k.dtype))
    return gc, w, u, tinv


def fwd_state(k: Tensor, w: Tensor, u: Tensor, gc: Tensor, h0: Tensor | None, store_vn: bool = True):
    """Chunk-sequential state pass from ``h0`` (None: zero).

    -> (hbuf [B,NT,Hv,K,V] entering state of every chunk, vnbuf [B,T,Hv,V] updates (None unless
    ``store_vn``), ht fp32 [B,Hv,K,V]).
    """
    B, T, Hk, Hv, K, V, NT = _dims(k, u)
    BV = _state_bv("state", K, V)
    hbuf = torch.empty(B, NT, Hv, K, V, device=k.device, dtype=k.dtype)
    vnbuf = torch.empty(B, T, Hv, V, device=k.device, dtype=k.dtype) if store_vn else None
    ht = torch.empty(B, Hv, K, V, device=k.device, dtype=torch.float32)
    _launch(_k.gdn_fwd_state_kernel, (V // BV, B * Hv),
        k, w, u, gc, h0 if h0 is not None else ht, hbuf, vnbuf if store_vn else hbuf, ht, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BV=BV, STORE_VN=store_vn, USE_H0=h0 is not None,
        num_warps=NUM_WARPS["state"], num_stages=_stages("state", k.dtype), **_flags(k.dtype))
    return hbuf, vnbuf, ht


def p2p_summary_pass(k: Tensor, w: Tensor, u: Tensor, gc: Tensor, hstride: int | None = None):
    """The zero-state pass and the group transitions of a State-P2P summary (``gdn_p2p_summary_kernel``)
    -> (hbuf [B,NG,Hv,K,K+V] with ``h0`` of every ``p2p_hstride``-th chunk in ``[..., K:]``, ht fp32
    [B,Hv,K,K+V] with ``S`` in ``[..., K:]``, gbuf fp32 [B,NG,Hv,K,K] the group transitions);
    ``p2p_chain`` fills the identity parts. ``hstride`` overrides ``p2p_hstride`` (for a caller that
    runs the output on some rows at a time: both must use one stride)."""
    B, T, Hk, Hv, K, V, NT = _dims(k, u)
    HS = hstride or p2p_hstride(B, Hv, V, NT, k.dtype, k.device)
    NG = triton_cdiv(NT, HS)
    BV, BVI = _state_bv("p2p_summary", K, V), min(P2P_IDENTITY_BV, K)
    hbuf = torch.empty(B, NG, Hv, K, K + V, device=k.device, dtype=k.dtype)
    ht = torch.empty(B, Hv, K, K + V, device=k.device, dtype=torch.float32)
    gbuf = torch.empty(B, NG, Hv, K, K, device=k.device, dtype=torch.float32)
    programs = B * Hv * (V // BV + NG * (K // BVI))
    _launch(_k.gdn_p2p_summary_kernel, (programs,),
        k, w, u, gc, hbuf, ht, gbuf, T, NT, B * Hv, Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BV=BV, BVI=BVI, HS=HS,
        num_warps=NUM_WARPS["p2p_summary"], num_stages=_stages("p2p_summary", k.dtype), **_flags(k.dtype))
    return hbuf, ht, gbuf


def p2p_chain(gbuf: Tensor, hbuf: Tensor, ht: Tensor) -> None:
    """Fills ``hbuf[..., :K]`` with the product ``P`` of the transitions before every group and
    ``ht[..., :K]`` with ``M`` (``gdn_p2p_chain_kernel``), in place."""
    B, NG, Hv, K, _ = gbuf.shape
    BVC = min(P2P_CHAIN_BV, K)
    _launch(_k.gdn_p2p_chain_kernel, (K // BVC, B * Hv),
        gbuf, hbuf, ht, NG, Hv=Hv, K=K, V=hbuf.shape[-1] - K, BVC=BVC,
        num_warps=NUM_WARPS["p2p_chain"], num_stages=NUM_STAGES["p2p_chain"], **_flags(hbuf.dtype))


def fwd_output(q: Tensor, k: Tensor, gc: Tensor, hbuf: Tensor, vnbuf: Tensor, scale: float) -> Tensor:
    """Output from a plain state pass's per-chunk entering states and updates."""
    B, T, Hk, K = q.shape
    Hv, V = gc.shape[2], vnbuf.shape[-1]
    NT, BV = triton_cdiv(T, CHUNK_SIZE), _output_bv(V)
    o = torch.empty(B, T, Hv, V, device=q.device, dtype=q.dtype)
    _launch(_k.gdn_fwd_output_kernel, (V // BV * NT, B * Hv),
        q, k, gc, hbuf, vnbuf, o, scale, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BV=BV, num_warps=NUM_WARPS["output"], **_flags(q.dtype))
    return o


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
    _launch(_k.gdn_p2p_output_kernel, (V // BV * triton_cdiv(NT, HS), B * Hv),
        q, k, w, u, gc, hbuf, h_in, o, scale, T, NT, Hk=Hk, Hv=Hv, K=K, V=V, HS=HS, BT=CHUNK_SIZE, BV=BV,
        num_warps=NUM_WARPS["p2p_output"], num_stages=_stages("p2p_output", q.dtype), **_flags(q.dtype))
    return o


def gdn_fwd(q, k, v, g, beta, h0, scale, store_tinv: bool = True):
    """Plain local forward -> (o, final state fp32, gc, w, u, tinv); the last four are saved for backward
    (``store_tinv=False``: by a caller that recomputes them, tinv None)."""
    h0 = h0.float().contiguous() if h0 is not None else None
    gc, w, u, tinv = fwd_prepare(k, v, g, beta, store_tinv)
    hbuf, vnbuf, ht = fwd_state(k, w, u, gc, h0)
    o = fwd_output(q, k, gc, hbuf, vnbuf, scale)
    return o, ht, gc, w, u, tinv


# ----------------------------------------------------------------------------- backward pieces


def bwd_dv_local(q, k, gc, do, scale):
    B, T, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    dvl = torch.empty(B, T, Hv, V, device=q.device, dtype=torch.float32)
    _launch(_k.gdn_bwd_dv_local_kernel, (triton_cdiv(T, CHUNK_SIZE), B * Hv),
        q, k, gc, do, dvl, scale, T, Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE,
        num_warps=NUM_WARPS["dv_local"], **_flags(q.dtype))
    return dvl


def bwd_state(q, k, w, gc, do, dvl, dht, scale, ny: int = 0, store: bool = True):
    """Reverse state pass -> (dhbuf [B,NT,Hv,K,ny+V] grads of leaving states, dvnbuf [B,T,Hv,ny+V],
    dh0 fp32 [B,Hv,K,ny+V]). ``ny = K`` runs the augmented pass: ``dh0[..., :K]`` is then ``M^T``.
    dhbuf and dvnbuf are in the token dtype (every reader feeds them to a dot in that dtype); without
    ``store`` they are not kept (None): the State-P2P summary needs only dh0."""
    B, T, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    key = "bwd_state_aug" if ny else "bwd_state"
    NT, NS, BV = triton_cdiv(T, CHUNK_SIZE), ny + V, _state_bv(key, K, V)
    dh0 = torch.empty(B, Hv, K, NS, device=q.device, dtype=torch.float32)
    dhbuf = torch.empty(B, NT, Hv, K, NS, device=q.device, dtype=q.dtype) if store else None
    dvnbuf = torch.empty(B, T, Hv, NS, device=q.device, dtype=q.dtype) if store else None
    _launch(_k.gdn_bwd_state_kernel, (NS // BV, B * Hv),
        q, k, w, gc, do, dvl, dht if dht is not None else dh0, dhbuf if store else dh0, dvnbuf if store else dh0,
        dh0, scale, T, NT, Hk=Hk, Hv=Hv, K=K, V=V, NX=ny, BT=CHUNK_SIZE, BV=BV, USE_DHT=dht is not None, STORE=store,
        num_warps=NUM_WARPS[key], num_stages=_stages(key, q.dtype), **_flags(q.dtype))
    return dhbuf, dvnbuf, dh0


def bwd_inter(q, k, w, u, gc, do, hbuf, dhbuf, dvnbuf, scale):
    """-> (dq [B,T,Hv,K] token dtype, dk fp32 [B,T,Hv,K], dw [B,T,Hv,K] token dtype, dgc fp32 [B,T,Hv]):
    the state and intra-chunk terms per value head; ``bwd_prepare`` adds the rest to dk and sums
    the value heads. dq is complete here, so the token dtype is enough before its fp32 sum (as
    fla-core keeps it); dk still takes the prepare terms, so it stays fp32. ``hbuf`` comes from a
    state pass run with ``store_vn=False`` (the updates are rebuilt from ``w``, ``u``)."""
    B, T, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    NT, BV = triton_cdiv(T, CHUNK_SIZE), _bv(K, V)
    dq = torch.empty(B, T, Hv, K, device=q.device, dtype=q.dtype)
    dk = torch.empty(B, T, Hv, K, device=q.device, dtype=torch.float32)
    dw = torch.empty(B, T, Hv, K, device=q.device, dtype=q.dtype)  # read only as a dot operand
    dgc = torch.empty(B, T, Hv, device=q.device, dtype=torch.float32)
    _launch(_k.gdn_bwd_inter_kernel, (NT, B * Hv),
        q, k, w, u, gc, do, hbuf, dhbuf, dvnbuf, dq, dk, dw, dgc, scale, T, NT,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BV=BV,
        num_warps=NUM_WARPS["inter"], num_stages=_stages("inter", q.dtype), **_flags(q.dtype))
    return dq, dk, dw, dgc


# column block of the prepare backward (tiles wider than 64 spilled registers on an H200)
WY_BC = 64
QK_FINISH_ROWS = 32


def bwd_prepare(q, k, v, beta, gc, tinv, dw, du, dqv, dkv, dgc, qk_grad_dtype=None, rstd=None):
    """The backward through prepare, and the finished q/k gradients -> (dq, dk [B,T,Hk,K], dv,
    dbeta fp32, dg fp32). ``dqv``/``dkv`` are ``bwd_inter``'s per-value-head terms (``dkv`` is
    updated in place); ``du`` is d(vn) from the backward state pass.
    ``rstd = (q_rstd, k_rstd)``: q and k are L2-normalised inputs and dq/dk are returned w.r.t. the
    raw ones. dq/dk come in ``qk_grad_dtype`` (default q's)."""
    B, T, Hk, Hv, K, V, NT = _dims(k, v)
    dv = torch.empty(B, T, Hv, V, device=k.device, dtype=v.dtype)
    dbeta = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    dg = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    _launch(_k.gdn_bwd_wy_kernel, (NT, B * Hv),
        k, v, beta, gc, tinv, dw, du, dkv, dgc, dv, dbeta, dg, T,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=CHUNK_SIZE, BC=min(WY_BC, K, V), num_warps=NUM_WARPS["bwd_wy"], **_flags(k.dtype))
    out = dict(device=k.device, dtype=qk_grad_dtype or q.dtype)
    dq, dk = torch.empty(B, T, Hk, K, **out), torch.empty(B, T, Hk, K, **out)
    q_rstd, k_rstd = rstd if rstd is not None else (dbeta, dbeta)
    N = B * T * Hk
    _launch(_k.gdn_bwd_qk_finish_kernel, (triton_cdiv(N, QK_FINISH_ROWS),),
        q, k, dqv, dkv, q_rstd, k_rstd, dq, dk, N, Hk=Hk, Hv=Hv, K=K, BR=QK_FINISH_ROWS, L2NORM=rstd is not None,
        num_warps=4)
    return dq, dk, dv, dbeta, dg


def gdn_bwd(q, k, v, g, beta, h0, gc, w, u, tinv, do, dht, scale, qk_grad_dtype=None, rstd=None, dvl=None,
            hbuf=None):
    """Plain local backward -> (dq, dk, dv, dg, dbeta, dh0 fp32). Recomputes the chunk states.
    ``qk_grad_dtype``: dtype of dq, dk (default q's; the layer ops ask for the dtype q and k had before
    their cast to the kernel dtype, so the fp32 sums are not rounded through bf16 at the end).
    ``rstd``: see ``bwd_prepare``; ``dvl`` (``bwd_dv_local``) and ``hbuf`` (the per-chunk states from
    ``h0``) when the caller has them. Each buffer is dropped after its last reader (peak memory)."""
    h0 = h0.float().contiguous() if h0 is not None else None
    dht = dht.float().contiguous() if dht is not None else None
    do = do.contiguous()
    if hbuf is None:
        hbuf, _, _ = fwd_state(k, w, u, gc, h0, store_vn=False)
    dvl = bwd_dv_local(q, k, gc, do, scale) if dvl is None else dvl
    dhbuf, dvnbuf, dh0 = bwd_state(q, k, w, gc, do, dvl, dht, scale)
    del dvl
    dqv, dkv, dw, dgc = bwd_inter(q, k, w, u, gc, do, hbuf, dhbuf, dvnbuf, scale)
    del hbuf, dhbuf
    dq, dk, dv, dbeta, dg = bwd_prepare(q, k, v, beta, gc, tinv, dw, dvnbuf, dqv, dkv, dgc, qk_grad_dtype, rstd)
    return dq, dk, dv, dg.to(g.dtype), dbeta.to(beta.dtype), dh0


# ----------------------------------------------------------------------------- State-P2P pieces


def p2p_fwd_summary(k, v, g, beta, store_tinv: bool = False, hstride: int | None = None):
    """Everything of a rank's forward that does not need the incoming state, plus its summary.

    -> (M fp32 [B,Hv,K,K], S fp32 [B,Hv,K,V], saved = (gc, w, u, tinv, hbuf)) where
    ``H_out = M @ H_in + S``. The summary pass and its chain replace the plain state pass; they
    store only the entering states ``[P | h0]`` of every ``p2p_hstride``-th chunk: the output
    rebuilds the updates from ``w`` and ``u``. tinv is None unless ``store_tinv``: the executor's
    backward runs prepare again.
    """
    K = k.shape[-1]
    gc, w, u, tinv = fwd_prepare(k, v, g, beta, store_tinv)
    hbuf, ht, gbuf = p2p_summary_pass(k, w, u, gc, hstride)
    p2p_chain(gbuf, hbuf, ht)
    M, S = ht[..., :K], ht[..., K:]
    return M, S, (gc, w, u, tinv, hbuf)


def p2p_fwd_output(q, k, saved, h_in: Tensor, scale: float, hstride: int | None = None) -> Tensor:
    """Output of the rank given its incoming state ``h_in`` (fp32 [B,Hv,K,V]); ``hstride`` as the
    summary's."""
    gc, w, u, _, hbuf = saved
    return p2p_output(q, k, w, u, gc, hbuf, h_in.float().contiguous(), scale, hstride)


def p2p_bwd_summary(q, k, w, gc, do, scale):
    """Gradient of the rank's loss w.r.t. its incoming state through its own outputs (``dH_local``,
    fp32 [B,Hv,K,V]), ``M^T`` from the same pass, and the intra-chunk d(vn) (``dvl``, kept for the
    finish). The serial chain then only does ``dH_in = dH_local + M^T dH_out``. One augmented
    reverse pass that keeps nothing per chunk: the finish is a plain backward from the true ``dH_out``."""
    K = k.shape[-1]
    dvl = bwd_dv_local(q, k, gc, do, scale)
    _, _, dh0 = bwd_state(q, k, w, gc, do, dvl, None, scale, ny=K, store=False)
    return dh0[..., K:], dh0[..., :K], dvl


def p2p_bwd_states(k, w, u, gc, h_in):
    """The finish's per-chunk states, recomputed from ``H_in`` (the forward kept only the summary's
    strided ones). They need no ``dH_out``: rank 0, which has no summary to run, computes them
    while ``dH_out`` is on its way."""
    return fwd_state(k, w, u, gc, h_in.float().contiguous(), store_vn=False)[0]


def p2p_bwd_finish(q, k, v, g, beta, gc, w, u, tinv, do, h_in, held: dict, dh_out, scale, qk_grad_dtype=None):
    """Input gradients of the rank once its incoming state ``h_in`` and the gradient of its leaving
    state ``dh_out`` are known -> (dq, dk, dv, dg, dbeta): the plain backward from both.
    ``held``: what the caller computed before ``dh_out`` arrived, ``"dvl"`` (the summary's or
    ``bwd_dv_local``'s) and ``"hbuf"`` (``p2p_bwd_states``); emptied here, so the plain backward
    frees each buffer after its last reader. A missing entry is computed.

    The finish used to rebuild each chunk's state gradient from suffix products the summary stored
    (``dh = dh0 + Y dH_out``): 1.6x a plain backward in all, with the summary's per-chunk buffers
    (K + V wide) held across the chain. A plain backward after a summary that stores nothing costs
    one extra reverse pass instead (1.2x)."""
    return gdn_bwd(q, k, v, g, beta, h_in, gc, w, u, tinv, do, dh_out, scale, qk_grad_dtype,
                   dvl=held.pop("dvl", None), hbuf=held.pop("hbuf", None))[:5]


# ----------------------------------------------------------------------------- q/k L2 norm

L2NORM_ROWS = 32


def l2norm_fwd(x: Tensor, eps: float = L2NORM_EPS):
    """-> (x / sqrt(sum(x^2) + eps) in x's dtype, rstd fp32 [...]) over the last dim."""
    D = x.shape[-1]
    N = x.numel() // D
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    _launch(_k.gdn_l2norm_fwd_kernel, (triton_cdiv(N, L2NORM_ROWS),), x, y, rstd, N, eps, D=D, BR=L2NORM_ROWS,
            num_warps=4)
    return y, rstd
