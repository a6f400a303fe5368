"""``torch.library`` custom ops over the Triton GDN kernels (namespace ``cpcompile``).

- ``cpcompile::gdn_chunk_fwd`` / ``cpcompile::gdn_chunk_bwd``: the local core, with autograd
  (``gdn_chunk_fwd`` also returns what its backward needs: gate cumsum ``gc``, ``w``, ``u``, the
  per-chunk ``(I + A)^-1`` and, with ``qk_l2norm``, the normalised q/k and their rstd; they are not
  differentiable). The q/k L2 norm lives inside the op, so its backward takes the core's fp32 dk
  and its dq as an fp32 sum of per-value-head terms, instead of both rounded to the token dtype
  between two ops.

State-P2P has no kernel-level ops here: its executor (``p2p_executor``, inside the layer-level
``cpcompile::gdn_p2p_chunk``) calls the launch functions directly.

Every op has a fake (meta) implementation so it traces as one node under ``torch.export`` and
``torch.compile``. The device capability check runs inside the real implementations (first use).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ....errors import CPInputError
from ..common import CHUNK_SIZE
from . import launch
from .capability import check_device


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.contiguous() if t is not None else None


# ----------------------------------------------------------------------------- local core


@torch.library.custom_op("cpcompile::gdn_chunk_fwd", mutates_args=())
def gdn_chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Optional[Tensor], scale: float, qk_l2norm: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (o [B,T,Hv,V] q.dtype, final state fp32 [B,Hv,K,V], gc, w, u, tinv, qn, kn, q_rstd, k_rstd).

    With ``qk_l2norm`` q and k are L2-normalised first (one Triton pass each); ``qn``/``kn`` are the
    normalised q and k and ``q_rstd``/``k_rstd`` fp32 [B,T,Hk] their rstd, kept for the backward,
    which finishes the norm's gradient inside its last kernel. Without it these four are empty."""
    check_device(q.device.type, q.device.index)
    q, k = _c(q), _c(k)
    if qk_l2norm:
        (q, q_rstd), (k, k_rstd) = launch.l2norm_fwd(q), launch.l2norm_fwd(k)
        qn, kn = q, k
    else:
        qn, kn, q_rstd, k_rstd = (q.new_empty(0) for _ in range(4))
    return (*launch.gdn_fwd(q, k, _c(v), _c(g), _c(beta), _c(initial_state), scale), qn, kn, q_rstd, k_rstd)


@gdn_chunk_fwd.register_fake
def _(q, k, v, g, beta, initial_state, scale, qk_l2norm=False):
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    f32 = torch.float32
    if qk_l2norm:  # the real op normalises contiguous copies
        norm = (q.new_empty(q.shape), k.new_empty(k.shape), q.new_empty(B, T, Hk, dtype=f32), k.new_empty(B, T, Hk, dtype=f32))
    else:
        norm = tuple(q.new_empty(0) for _ in range(4))
    return (q.new_empty(B, T, Hv, V), q.new_empty(B, Hv, K, V, dtype=f32), q.new_empty(B, T, Hv, dtype=f32),
            k.new_empty(B, T, Hv, K), k.new_empty(B, T, Hv, V), q.new_empty(B, T, Hv, CHUNK_SIZE, dtype=f32), *norm)


@torch.library.custom_op("cpcompile::gdn_chunk_bwd", mutates_args=())
def gdn_chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                  gc: Tensor, w: Tensor, u: Tensor, tinv: Tensor, do: Tensor, dht: Optional[Tensor], scale: float,
                  q_rstd: Optional[Tensor] = None, k_rstd: Optional[Tensor] = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dg, dbeta in their inputs' dtypes, d initial state fp32 [B,Hv,K,V]).
    With ``q_rstd``/``k_rstd``, q and k are the normalised ones and dq/dk are w.r.t. the raw inputs."""
    check_device(q.device.type, q.device.index)
    if (q_rstd is None) != (k_rstd is None):
        raise CPInputError("cpcompile::gdn_chunk_bwd: q_rstd and k_rstd come together (q and k normalised in the "
                           "op) or not at all")
    rstd = (_c(q_rstd), _c(k_rstd)) if q_rstd is not None else None
    return launch.gdn_bwd(_c(q), _c(k), _c(v), _c(g), _c(beta), _c(initial_state), _c(gc), _c(w), _c(u), _c(tinv),
                          _c(do), _c(dht), scale, rstd=rstd)


@gdn_chunk_bwd.register_fake
def _(q, k, v, g, beta, initial_state, gc, w, u, tinv, do, dht, scale, q_rstd=None, k_rstd=None):
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), q.new_empty(B, Hv, K, V, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, scale, qk_l2norm = inputs
    _, _, gc, w, u, tinv, qn, kn, q_rstd, k_rstd = output
    ctx.scale = scale
    ctx.has_h0 = initial_state is not None
    ctx.qk_l2norm = qk_l2norm
    if qk_l2norm:  # the backward reads only the normalised q/k (and their rstd), not the raw ones
        q, k = qn, kn
    ctx.save_for_backward(q, k, v, g, beta, initial_state, gc, w, u, tinv, q_rstd, k_rstd)
    ctx.mark_non_differentiable(gc, w, u, tinv, qn, kn, q_rstd, k_rstd)
    # unused outputs' gradients stay None: materialised, they were zero-filled tensors as large as
    # w, u, tinv, qn and kn on every backward (0.16 ms and ~0.5 GiB at T=16K on an H200)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dht, *_not_differentiable):
    q, k, v, g, beta, initial_state, gc, w, u, tinv, q_rstd, k_rstd = ctx.saved_tensors
    if do is None:
        do = torch.zeros(*v.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
    rstd = (q_rstd, k_rstd) if ctx.qk_l2norm else (None, None)
    dq, dk, dv, dg, dbeta, dh0 = gdn_chunk_bwd(q, k, v, g, beta, initial_state, gc, w, u, tinv,
                                               do.to(q.dtype), dht, ctx.scale, *rstd)
    dh0 = dh0.to(initial_state.dtype) if ctx.has_h0 else None
    return dq, dk, dv, dg, dbeta, dh0, None, None


gdn_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)
