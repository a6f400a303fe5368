"""The ``triton`` backend of the layer-level GDN ops ``cpcompile::gdn_chunk`` / ``gdn_summary``
(``cpcompile.gdn_ops``): what their real implementations run. Every path is Triton kernels
(plus dtype casts and sums of gradients); there is no eager fallback.

- chunk forward: ``gdn_fwd`` (prepare, state pass, output) from the given initial state;
- chunk backward: ``fwd_prepare`` again (the op's autograd saves only its inputs), then ``gdn_bwd``
  (recomputed states, every input gradient and the initial state's);
- summary forward: the augmented state pass (``p2p_fwd_summary``) gives ``M`` and ``S`` at once;
- summary backward: ``summary_bwd``, two final-state-gradient chunk backwards (``S``: zero state;
  ``M``: entering state ``I``, zero values) sharing one prepare.

q and k are cast to the kernel dtype (v's, see ``capability.kernel_dtype``); results come back in
the dtypes the ops' fake implementations promise.
"""

from __future__ import annotations

from torch import Tensor

from . import launch
from .capability import cast_and_check


def _c(t: Tensor | None) -> Tensor | None:
    return t.contiguous() if t is not None else None


def chunk_forward(q, k, v, g, beta, initial_state, scale: float, chunk_size: int) -> Tensor:
    qd, kd = cast_and_check(q, k, v, g, beta, initial_state, chunk_size)
    o, *_ = launch.gdn_fwd(_c(qd), _c(kd), _c(v), _c(g), _c(beta), initial_state, scale)
    return o.to(q.dtype).contiguous()


def chunk_backward(grad_out, q, k, v, g, beta, initial_state, scale: float, chunk_size: int) -> list[Tensor]:
    qd, kd = cast_and_check(q, k, v, g, beta, initial_state, chunk_size)
    qd, kd, vc, gc_in, bc = (_c(x) for x in (qd, kd, v, g, beta))
    gc, w, u, tinv = launch.fwd_prepare(kd, vc, gc_in, bc)
    dq, dk, dv, dg, dbeta, dh0 = launch.gdn_bwd(qd, kd, vc, gc_in, bc, initial_state, gc, w, u, tinv,
                                                grad_out.to(v.dtype).contiguous(), None, scale,
                                                qk_grad_dtype=q.dtype if q.dtype == k.dtype else None)
    dh0 = dh0.to(initial_state.dtype) if initial_state is not None else q.new_empty(0)
    return [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0]


def summary_forward(k, v, g, beta, chunk_size: int) -> tuple[Tensor, Tensor]:
    _, kd = cast_and_check(k, k, v, g, beta, None, chunk_size)
    M, S, _ = launch.p2p_fwd_summary(_c(kd), _c(v), _c(g), _c(beta))
    return M.contiguous(), S.contiguous()


def summary_backward(grad_m, grad_s, k, v, g, beta, chunk_size: int) -> list[Tensor]:
    _, kd = cast_and_check(k, k, v, g, beta, None, chunk_size)
    dk, dv, dg, dbeta = launch.summary_bwd(_c(kd), _c(v), _c(g), _c(beta), grad_m, grad_s, k_grad_dtype=k.dtype)
    return [dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype)]
