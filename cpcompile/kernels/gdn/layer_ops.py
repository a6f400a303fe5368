"""The Gated DeltaNet core as `cpcompile::` custom ops, so a traced GDN layer has one core node.

    gdn_chunk(q, k, v, g, beta, initial_state?, scale, chunk_size, backend, starts?) -> o
    gdn_summary(k, v, g, beta, chunk_size, "eager", starts?) -> (M, S)      # H_out = M @ H_in + S
    gdn_p2p_chunk(q, k, v, g, beta, scale, chunk_size, group_name, rank, world) -> (o, H_in)
                                                 # triton State-P2P: one rank's core and its chain
    gdn_p2p_head_tail_chunk(...same...) -> (o, H_in)  # the same in Head-Tail order, fragments folded

q and k arrive already L2-normalised (the layer does that in the graph), g is the log decay,
beta the write strength; layouts as in `cpcompile.kernels.gdn.eager`. `starts [B, T]` (bool, or
None for one document per row) marks the first tokens of packed documents, where the state resets
(both backends; State-P2P on triton takes them as gates, `passes/gdn/p2p.py`). Each op has a fake
implementation and an autograd formula (a backward op), so graphs holding them export, compile
and differentiate like ATen ops.

Backends: `eager` runs the pure-PyTorch oracle (backward: recompute under `torch.func.vjp`);
`triton` runs cpcompile's Triton kernels forward and backward (`triton.backend`, and
`triton.p2p_executor` for `gdn_p2p_chunk`, `triton.head_tail_executor` for its Head-Tail twin), with
the capability check at region build (`require_backend`), at trace time (fake impls) and at run
time — never a fallback. Triton is imported only when the triton backend is used.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...errors import CPInputError
from ..precision import without_autocast
from . import eager, inputs
from .common import check_backend


def require_backend(backend: str) -> None:
    """Fail before anything runs when `backend` cannot run here (never fall back).

    `triton`: the capability check that needs no tensor (triton importable; a CUDA device of
    compute capability >= 8.0, an Ascend NPU, or `TRITON_INTERPRET=1` for CPU tensors). It raises
    `GDNCapabilityError` naming the capability. Shapes, dtypes and the tensors' device are checked
    when the region is traced (the ops' fake implementations) and again at run time.
    """
    check_backend(backend)
    if backend == "triton":
        from .triton.capability import check_environment

        check_environment()


def _triton():
    from .triton import backend as triton_backend  # imports triton: first use only

    return triton_backend


def _check_triton(q, k, v, g, beta, initial_state, chunk_size) -> None:
    """Input and device capabilities on (fake) tensor metadata: a region fails at trace time."""
    from .triton.capability import cast_and_check

    cast_and_check(q, k, v, g, beta, initial_state, chunk_size)


@without_autocast  # the kernels keep their state and decay in fp32 (`inputs.compute_dtype`)
def _chunk(q, k, v, g, beta, initial_state, scale, chunk_size, backend, starts=None) -> Tensor:
    check_backend(backend)
    inputs.check_starts(starts, g)
    if backend == "triton":
        return _triton().chunk_forward(q, k, v, g, beta, initial_state, scale, chunk_size, starts)
    out, _ = eager.chunk_gated_delta_rule_eager(q, k, v, g, beta, chunk_size=chunk_size, scale=scale,
                                                initial_state=initial_state, starts=starts)
    return out.contiguous()  # the fake implementation promises a contiguous result


def _eager_summary_only(backend: str) -> None:
    check_backend(backend)
    if backend != "eager":
        raise CPInputError(f"cpcompile::gdn_summary runs the eager backend only, got {backend!r}; State-P2P "
                         "on the triton backend is cpcompile::gdn_p2p_chunk")


@without_autocast
def _summary(k, v, g, beta, chunk_size, backend, starts=None) -> tuple[Tensor, Tensor]:
    _eager_summary_only(backend)
    m, s = eager.gdn_segment_summary(k, v, g, beta, chunk_size=chunk_size, starts=starts)
    return m.contiguous(), s.contiguous()


def _grads_by_recompute(fn, inputs: list[Tensor | None], grad_outputs: list[Tensor]) -> list[Tensor]:
    """Gradients of `fn(*inputs)` by recomputing it under `torch.func.vjp`.

    A custom op's implementation runs below the autograd dispatch key, so plain autograd is
    off there; functorch's transform is not. Absent (None) inputs get an empty gradient.
    """
    present = [i for i, x in enumerate(inputs) if x is not None]

    def of_present(*tensors):
        full = list(inputs)
        for i, t in zip(present, tensors):
            full[i] = t
        return fn(*full)

    _, vjp = torch.func.vjp(of_present, *(inputs[i] for i in present))
    outputs = tuple(grad_outputs)
    grads = iter(vjp(outputs if len(outputs) > 1 else outputs[0]))
    return [next(grads) if x is not None else grad_outputs[0].new_empty(0) for x in inputs]


def _contiguous(grads: list[Tensor]) -> list[Tensor]:
    """Backward ops promise contiguous gradients (their fake implementations say so), so that
    a compiled backward may view them freely whatever layout the kernels produced."""
    return [g.contiguous() for g in grads]


def _like(x: Tensor) -> Tensor:
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------- gdn_chunk


@torch.library.custom_op("cpcompile::gdn_chunk", mutates_args=())
def gdn_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
              scale: float, chunk_size: int, backend: str, starts: Tensor | None = None) -> Tensor:
    return _chunk(q, k, v, g, beta, initial_state, scale, chunk_size, backend, starts)


@gdn_chunk.register_fake
def _(q, k, v, g, beta, initial_state, scale, chunk_size, backend, starts=None):
    inputs.check_starts(starts, g)
    if backend == "triton":
        _check_triton(q, k, v, g, beta, initial_state, chunk_size)
    return v.new_empty(v.shape, dtype=q.dtype)


@torch.library.custom_op("cpcompile::gdn_chunk_backward", mutates_args=())
def gdn_chunk_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       initial_state: Tensor | None, scale: float, chunk_size: int,
                       backend: str, starts: Tensor | None = None) -> list[Tensor]:
    if backend == "triton":
        return _contiguous(_triton().chunk_backward(grad_out, q, k, v, g, beta, initial_state, scale, chunk_size,
                                                    starts))

    def forward(q, k, v, g, beta, h0):
        return _chunk(q, k, v, g, beta, h0, scale, chunk_size, backend, starts)

    return _contiguous(_grads_by_recompute(forward, [q, k, v, g, beta, initial_state], [grad_out]))


@gdn_chunk_backward.register_fake
def _(grad_out, q, k, v, g, beta, initial_state, scale, chunk_size, backend, starts=None):
    state = _like(initial_state) if initial_state is not None else grad_out.new_empty(0)
    return [_like(x) for x in (q, k, v, g, beta)] + [state]


def _chunk_setup(ctx, inputs, output):
    q, k, v, g, beta, initial_state, scale, chunk_size, backend, starts = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, starts)
    ctx.scale, ctx.chunk_size, ctx.backend = scale, chunk_size, backend


def _chunk_grad(ctx, grad_out):
    q, k, v, g, beta, initial_state, starts = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dh0 = gdn_chunk_backward(
        grad_out, q, k, v, g, beta, initial_state, ctx.scale, ctx.chunk_size, ctx.backend, starts
    )
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None, None, None


gdn_chunk.register_autograd(_chunk_grad, setup_context=_chunk_setup)


# --------------------------------------------------------------------------- gdn_summary


@torch.library.custom_op("cpcompile::gdn_summary", mutates_args=())
def gdn_summary(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int, backend: str,
                starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _summary(k, v, g, beta, chunk_size, backend, starts)


def _summary_shapes(k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[list[int], list[int], torch.dtype]:
    batch, heads, key_dim, value_dim = k.shape[0], v.shape[2], k.shape[-1], v.shape[-1]
    return [batch, heads, key_dim, key_dim], [batch, heads, key_dim, value_dim], inputs.compute_dtype(k, v, g, beta)


@gdn_summary.register_fake
def _(k, v, g, beta, chunk_size, backend, starts=None):
    _eager_summary_only(backend)
    m_shape, s_shape, dtype = _summary_shapes(k, v, g, beta)
    return k.new_empty(m_shape, dtype=dtype), k.new_empty(s_shape, dtype=dtype)


@torch.library.custom_op("cpcompile::gdn_summary_backward", mutates_args=())
def gdn_summary_backward(grad_m: Tensor, grad_s: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         chunk_size: int, backend: str, starts: Tensor | None = None) -> list[Tensor]:
    def forward(k, v, g, beta):
        return _summary(k, v, g, beta, chunk_size, backend, starts)

    return _contiguous(_grads_by_recompute(forward, [k, v, g, beta], [grad_m, grad_s]))


@gdn_summary_backward.register_fake
def _(grad_m, grad_s, k, v, g, beta, chunk_size, backend, starts=None):
    return [_like(x) for x in (k, v, g, beta)]


def _summary_setup(ctx, inputs, output):
    k, v, g, beta, chunk_size, backend, starts = inputs
    ctx.save_for_backward(k, v, g, beta, starts)
    ctx.chunk_size, ctx.backend = chunk_size, backend


def _summary_grad(ctx, grad_m, grad_s):
    k, v, g, beta, starts = ctx.saved_tensors
    dk, dv, dg, dbeta = gdn_summary_backward(grad_m, grad_s, k, v, g, beta, ctx.chunk_size, ctx.backend, starts)
    return dk, dv, dg, dbeta, None, None, None


gdn_summary.register_autograd(_summary_grad, setup_context=_summary_setup)


# --------------------------------------------------------------------------- gdn_p2p_chunk (triton)
#
# State-P2P with the Triton kernels is one op, forward and backward, whose implementation talks to
# its ring neighbours itself (`triton.p2p_executor`). Why not graph nodes around a
# visible chain, as the eager backend has: the split kernels need the backward in two phases
# around the reverse state-gradient chain (local state-gradient summary -> receive dH_out -> send
# dH_in -> finish the input gradients). Separate summary and core nodes would instead get autograd's
# per-node backward: a full core backward from H_in plus an exact summary backward (two more
# final-state backwards), about 2.4x a plain backward, where the executor does one state-gradient
# summary plus one plain backward.


def _ring(group_name: str, rank: int, world: int):
    from .triton.p2p_executor import Ring

    return Ring.of(group_name, rank, world)


@torch.library.custom_op("cpcompile::gdn_p2p_chunk", mutates_args=())
def gdn_p2p_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, chunk_size: int,
                  group_name: str, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """-> (o, H_in): this rank's core output and the fp32 state that entered its segment."""
    from .triton.p2p_executor import p2p_forward

    return without_autocast(p2p_forward)(q, k, v, g, beta, scale, chunk_size, _ring(group_name, rank, world))


@gdn_p2p_chunk.register_fake
def _p2p_chunk_fake(q, k, v, g, beta, scale, chunk_size, group_name, rank, world):
    _check_triton(q, k, v, g, beta, None, chunk_size)
    state_shape = [k.shape[0], v.shape[2], k.shape[3], v.shape[3]]
    return v.new_empty(v.shape, dtype=q.dtype), k.new_empty(state_shape, dtype=torch.float32)


@torch.library.custom_op("cpcompile::gdn_p2p_chunk_backward", mutates_args=())
def gdn_p2p_chunk_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           h_in: Tensor, scale: float, chunk_size: int, group_name: str, rank: int,
                           world: int) -> list[Tensor]:
    from .triton.p2p_executor import p2p_backward

    return p2p_backward(grad_out, q, k, v, g, beta, h_in, scale, chunk_size, _ring(group_name, rank, world))


@gdn_p2p_chunk_backward.register_fake
def _(grad_out, q, k, v, g, beta, h_in, scale, chunk_size, group_name, rank, world):
    return [_like(x) for x in (q, k, v, g, beta)]


def _p2p_setup(ctx, inputs, output):
    q, k, v, g, beta, *ctx.config = inputs
    ctx.save_for_backward(q, k, v, g, beta, output[1])
    ctx.mark_non_differentiable(output[1])


def _p2p_grad(ctx, grad_out, _grad_h_in):
    q, k, v, g, beta, h_in = ctx.saved_tensors
    if grad_out is None:  # still exchange the state gradient: the neighbours wait for it
        grad_out = torch.zeros(v.shape, dtype=q.dtype, device=v.device)
    grads = gdn_p2p_chunk_backward(grad_out, q, k, v, g, beta, h_in, *ctx.config)
    return (*grads, None, None, None, None, None)


gdn_p2p_chunk.register_autograd(_p2p_grad, setup_context=_p2p_setup)


# --------------------------------------------------------------------------- gdn_p2p_head_tail_chunk (triton)
#
# State-P2P in Head-Tail order (`passes/gdn/p2p_head_tail.py`): the rank's two fragments come
# folded into the batch, `[2B, c, ...]`, heads' rows first; one op for the same reason as above.


@torch.library.custom_op("cpcompile::gdn_p2p_head_tail_chunk", mutates_args=())
def gdn_p2p_head_tail_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, chunk_size: int,
                            group_name: str, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """-> (o, H_in): both fragments' core output and the fp32 states that entered them (folded)."""
    from .triton.head_tail_executor import head_tail_forward

    return without_autocast(head_tail_forward)(q, k, v, g, beta, scale, chunk_size, _ring(group_name, rank, world))


@gdn_p2p_head_tail_chunk.register_fake
def _(q, k, v, g, beta, scale, chunk_size, group_name, rank, world):
    if k.shape[0] % 2:
        raise CPInputError(f"gdn_p2p_head_tail_chunk takes a rank's two fragments folded into the batch; "
                           f"got an odd batch of {k.shape[0]}")
    return _p2p_chunk_fake(q, k, v, g, beta, scale, chunk_size, group_name, rank, world)


@torch.library.custom_op("cpcompile::gdn_p2p_head_tail_chunk_backward", mutates_args=())
def gdn_p2p_head_tail_chunk_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                     h_in: Tensor, scale: float, chunk_size: int, group_name: str, rank: int,
                                     world: int) -> list[Tensor]:
    from .triton.head_tail_executor import head_tail_backward

    return head_tail_backward(grad_out, q, k, v, g, beta, h_in, scale, chunk_size, _ring(group_name, rank, world))


@gdn_p2p_head_tail_chunk_backward.register_fake
def _(grad_out, q, k, v, g, beta, h_in, scale, chunk_size, group_name, rank, world):
    return [_like(x) for x in (q, k, v, g, beta)]


def _p2p_head_tail_grad(ctx, grad_out, _grad_h_in):
    q, k, v, g, beta, h_in = ctx.saved_tensors
    if grad_out is None:  # still exchange the state gradients: the neighbours wait for them
        grad_out = torch.zeros(v.shape, dtype=q.dtype, device=v.device)
    grads = gdn_p2p_head_tail_chunk_backward(grad_out, q, k, v, g, beta, h_in, *ctx.config)
    return (*grads, None, None, None, None, None)


gdn_p2p_head_tail_chunk.register_autograd(_p2p_head_tail_grad, setup_context=_p2p_setup)
