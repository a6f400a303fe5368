"""The Triton GDN core's entry points: the plain local forward and backward, and the State-P2P pieces.

Plain local GDN:   ``gdn_fwd`` / ``gdn_bwd``.
State-P2P pieces:  ``p2p_fwd_summary`` -> serial ``M @ H + S`` -> ``p2p_fwd_output``;
                   ``p2p_bwd_summary`` -> serial ``dH_local + M^T dH`` -> ``p2p_bwd_finish`` (a plain
                   backward from ``H_in`` and ``dH``).
All tensors are contiguous ``[B, T, H, D]`` token tensors, fp32 states ``[B, Hv, K, V]``.

Per chunk (chunk size ``BT`` = 64), entered with state ``h`` (``gc`` = in-chunk inclusive cumsum of
``g``, ``gl`` its last value, ``E_ij = exp(gc_i - gc_j)``)::

    A   = strictly_lower(beta_i E_ij k_i.k_j),   Tinv = (I + A)^-1
    w   = Tinv (beta exp(gc) k),  u = Tinv (beta v)          # state-independent ("prepare")
    vn  = u - w h                                            # true per-token updates
    o   = scale (exp(gc) q h + lower_incl(E q k^T) vn)
    h'  = exp(gl) h + (exp(gl - gc) k)^T vn

One file per stage, each holding its kernel(s), its launcher and its tuning constants (as
flash-linear-attention's ``ops/common/chunk_o.py``): forward ``prepare``, ``state``, ``output``;
State-P2P ``p2p_summary`` (the affine summary ``H_out = M H_in + S``) and ``p2p_output``; backward
``bwd_state`` (also the augmented pass that yields ``M^T``), ``bwd_inter``, ``bwd_prepare``; the
q/k ``l2norm``. The shared ``@triton.jit`` pieces are in ``helpers``; how a kernel is launched (the
per-kernel warps / stages table, the pipeline-depth fitting, the dot-precision flags) in
``launching``. This module re-exports every stage's launcher, so ``launch.fwd_prepare`` and the
like keep working for callers, tests and benchmarks.
"""

from __future__ import annotations

from torch import Tensor

from ..common import CHUNK_SIZE
from .bwd_inter import bwd_inter
from .bwd_prepare import bwd_prepare
from .bwd_state import bwd_dv_local, bwd_state
from .l2norm import l2norm_fwd
from .launching import triton_cdiv
from .output import fwd_output
from .p2p_output import p2p_hstride, p2p_output
from .p2p_summary import p2p_chain, p2p_summary_pass
from .prepare import fwd_prepare
from .state import fwd_state

__all__ = [
    "CHUNK_SIZE", "bwd_dv_local", "bwd_inter", "bwd_prepare", "bwd_state", "fwd_output", "fwd_prepare", "fwd_state",
    "gdn_bwd", "gdn_fwd", "l2norm_fwd", "p2p_bwd_finish", "p2p_bwd_states", "p2p_bwd_summary", "p2p_chain",
    "p2p_fwd_output", "p2p_fwd_summary", "p2p_hstride", "p2p_output", "p2p_summary_pass", "triton_cdiv",
]


def gdn_fwd(q, k, v, g, beta, h0, scale, store_tinv: bool = True):
    """Plain local forward -> (o, final state fp32, gc, w, u, tinv); the last four are saved for backward
    (``store_tinv=False``: by a caller that recomputes them, tinv None)."""
    h0 = h0.float().contiguous() if h0 is not None else None
    gc, w, u, tinv = fwd_prepare(k, v, g, beta, store_tinv)
    hbuf, vnbuf, ht = fwd_state(k, w, u, gc, h0)
    o = fwd_output(q, k, gc, hbuf, vnbuf, scale)
    return o, ht, gc, w, u, tinv


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
