"""The ``triton`` backend of the layer-level GDN op ``cpcompile::gdn_chunk`` (``kernels.gdn.layer_ops``):
what its real implementation runs (State-P2P has its own executor, ``p2p_executor``). Every path is
Triton kernels (plus dtype casts and sums of gradients); there is no eager fallback.

- chunk forward: ``gdn_fwd`` (prepare, state pass, output) from the given initial state; prepare
  stores no ``tinv``, which only the backward reads and recomputes;
- chunk backward: ``fwd_prepare`` again (the op's autograd saves only its inputs), then ``gdn_bwd``
  (recomputed states, every input gradient and the initial state's);

q and k are cast to the kernel dtype (v's, see ``capability.kernel_dtype``); results come back in
the dtypes the ops' fake implementations promise.

Packed documents (``starts [B, T]``) reach the kernels as gates: every start's log decay becomes
``common.RESET_LOG_DECAY`` (``reset_decay_at_starts``), which cuts the state at the start; its
gradient is zero there, as in the eager oracle.
"""

from __future__ import annotations

from torch import Tensor

from ..common import reset_decay_at_starts
from . import launch
from .capability import cast_and_check


def _c(t: Tensor | None) -> Tensor | None:
    return t.contiguous() if t is not None else None


def chunk_forward(q, k, v, g, beta, initial_state, scale: float, chunk_size: int,
                  starts: Tensor | None = None) -> Tensor:
    qd, kd = cast_and_check(q, k, v, g, beta, initial_state, chunk_size)
    if starts is not None:
        g = reset_decay_at_starts(g, starts)
    o, *_ = launch.gdn_fwd(_c(qd), _c(kd), _c(v), _c(g), _c(beta), initial_state, scale, store_tinv=False)
    return o.to(q.dtype).contiguous()


def chunk_backward(grad_out, q, k, v, g, beta, initial_state, scale: float, chunk_size: int,
                   starts: Tensor | None = None) -> list[Tensor]:
    qd, kd = cast_and_check(q, k, v, g, beta, initial_state, chunk_size)
    if starts is not None:
        g = reset_decay_at_starts(g, starts)
    qd, kd, vc, gc_in, bc = (_c(x) for x in (qd, kd, v, g, beta))
    gc, w, u, tinv = launch.fwd_prepare(kd, vc, gc_in, bc)
    dq, dk, dv, dg, dbeta, dh0 = launch.gdn_bwd(qd, kd, vc, gc_in, bc, initial_state, gc, w, u, tinv,
                                                grad_out.to(v.dtype).contiguous(), None, scale,
                                                qk_grad_dtype=q.dtype if q.dtype == k.dtype else None)
    dh0 = dh0.to(initial_state.dtype) if initial_state is not None else q.new_empty(0)
    if starts is not None:
        dg = dg.masked_fill(starts[..., None], 0.0)
    return [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0]
