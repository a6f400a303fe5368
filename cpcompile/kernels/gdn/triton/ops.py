"""``torch.library`` custom ops over the Triton GDN kernels (namespace ``cpcompile``).

- ``cpcompile::gdn_chunk_fwd`` / ``cpcompile::gdn_chunk_bwd``: the local core, with autograd
  (``gdn_chunk_fwd`` also returns what its backward needs: gate cumsum ``gc``, ``w``, ``u`` and the
  per-chunk ``(I + A)^-1``; they are not differentiable).
- ``cpcompile::gdn_l2norm`` / ``gdn_l2norm_bwd``: the q/k L2 norm, with autograd.

State-P2P has no kernel-level ops here: its executor (``p2p_executor``, inside the layer-level
``cpcompile::gdn_p2p_chunk``) calls the launch functions directly.

Every op has a fake (meta) implementation so it traces as one node under ``torch.export`` and
``torch.compile``. The device capability check runs inside the real implementations (first use).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..common import CHUNK_SIZE
from . import launch
from .capability import check_device


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.contiguous() if t is not None else None


# ----------------------------------------------------------------------------- local core


@torch.library.custom_op("cpcompile::gdn_chunk_fwd", mutates_args=())
def gdn_chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Optional[Tensor], scale: float
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (o [B,T,Hv,V] q.dtype, final state fp32 [B,Hv,K,V], gc, w, u, tinv)."""
    check_device(q.device.type, q.device.index)
    return launch.gdn_fwd(_c(q), _c(k), _c(v), _c(g), _c(beta), _c(initial_state), scale)


@gdn_chunk_fwd.register_fake
def _(q, k, v, g, beta, initial_state, scale):
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    f32 = torch.float32
    return (q.new_empty(B, T, Hv, V), q.new_empty(B, Hv, K, V, dtype=f32), q.new_empty(B, T, Hv, dtype=f32),
            k.new_empty(B, T, Hv, K), k.new_empty(B, T, Hv, V), q.new_empty(B, T, Hv, CHUNK_SIZE, dtype=f32))


@torch.library.custom_op("cpcompile::gdn_chunk_bwd", mutates_args=())
def gdn_chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                  gc: Tensor, w: Tensor, u: Tensor, tinv: Tensor, do: Tensor, dht: Optional[Tensor], scale: float
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dg, dbeta in their inputs' dtypes, d initial state fp32 [B,Hv,K,V])."""
    check_device(q.device.type, q.device.index)
    return launch.gdn_bwd(_c(q), _c(k), _c(v), _c(g), _c(beta), _c(initial_state), _c(gc), _c(w), _c(u), _c(tinv),
                          _c(do), _c(dht), scale)


@gdn_chunk_bwd.register_fake
def _(q, k, v, g, beta, initial_state, gc, w, u, tinv, do, dht, scale):
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), q.new_empty(B, Hv, K, V, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, scale = inputs
    _, _, gc, w, u, tinv = output
    ctx.scale = scale
    ctx.has_h0 = initial_state is not None
    ctx.save_for_backward(q, k, v, g, beta, initial_state, gc, w, u, tinv)
    ctx.mark_non_differentiable(gc, w, u, tinv)


def _backward(ctx, do, dht, _dgc, _dw, _du, _dtinv):
    q, k, v, g, beta, initial_state, gc, w, u, tinv = ctx.saved_tensors
    if do is None:
        do = torch.zeros(*v.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
    dq, dk, dv, dg, dbeta, dh0 = gdn_chunk_bwd(q, k, v, g, beta, initial_state, gc, w, u, tinv,
                                               do.to(q.dtype), dht, ctx.scale)
    dh0 = dh0.to(initial_state.dtype) if ctx.has_h0 else None
    return dq, dk, dv, dg, dbeta, dh0, None


gdn_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- q/k L2 norm


@torch.library.custom_op("cpcompile::gdn_l2norm", mutates_args=())
def gdn_l2norm(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x * rsqrt(sum(x^2, -1) + 1e-6)`` in x's dtype (computed in fp32), plus rstd fp32."""
    check_device(x.device.type, x.device.index)
    return launch.l2norm_fwd(x.contiguous())


@gdn_l2norm.register_fake
def _(x):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cpcompile::gdn_l2norm_bwd", mutates_args=())
def gdn_l2norm_bwd(x: Tensor, rstd: Tensor, dy: Tensor) -> Tensor:
    check_device(x.device.type, x.device.index)
    return launch.l2norm_bwd(x.contiguous(), rstd.contiguous(), dy.contiguous())


@gdn_l2norm_bwd.register_fake
def _(x, rstd, dy):
    return torch.empty_like(x)


def _l2_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.mark_non_differentiable(output[1])


def _l2_backward(ctx, dy, _drstd):
    x, rstd = ctx.saved_tensors
    return gdn_l2norm_bwd(x, rstd, dy.to(x.dtype))


gdn_l2norm.register_autograd(_l2_backward, setup_context=_l2_setup)
