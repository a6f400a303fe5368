"""The Gated DeltaNet core as `cpcompile::` custom ops, so a traced GDN layer has one core node.

    gdn_chunk(q, k, v, g, beta, initial_state?, scale, chunk_size, backend) -> o
    gdn_summary(k, v, g, beta, chunk_size, backend) -> (M, S)      # H_out = M @ H_in + S

q and k arrive already L2-normalised (the layer does that in the graph), g is the log decay,
beta the write strength; layouts as in `cpcompile.kernels.gdn_eager`. Each op has a fake
implementation and an autograd formula (a backward op that recomputes the forward under
autograd), so graphs holding them export, compile and differentiate like ATen ops.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kernels import gdn_eager

BACKENDS = ("eager", "triton")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"GDN backend must be one of {BACKENDS}, got {backend!r}")


def require_backend(backend: str) -> None:
    """Fail before anything runs when `backend` cannot run here (never fall back)."""
    check_backend(backend)
    if backend == "triton":
        raise NotImplementedError("the triton GDN backend is not available yet; use backend='eager'")


def _chunk_fn(backend: str):
    require_backend(backend)
    return gdn_eager.chunk_gated_delta_rule_eager


def _summary_fn(backend: str):
    require_backend(backend)
    return gdn_eager.gdn_segment_summary


def _chunk(q, k, v, g, beta, initial_state, scale, chunk_size, backend) -> Tensor:
    out, _ = _chunk_fn(backend)(q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=initial_state)
    return out.contiguous()  # the fake implementation promises a contiguous result


def _summary(k, v, g, beta, chunk_size, backend) -> tuple[Tensor, Tensor]:
    m, s = _summary_fn(backend)(k, v, g, beta, chunk_size=chunk_size)
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
    return [next(grads) if x is not None else torch.empty(0) for x in inputs]


# --------------------------------------------------------------------------- gdn_chunk


@torch.library.custom_op("cpcompile::gdn_chunk", mutates_args=())
def gdn_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
              scale: float, chunk_size: int, backend: str) -> Tensor:
    return _chunk(q, k, v, g, beta, initial_state, scale, chunk_size, backend)


@gdn_chunk.register_fake
def _(q, k, v, g, beta, initial_state, scale, chunk_size, backend):
    return v.new_empty(v.shape, dtype=q.dtype)


@torch.library.custom_op("cpcompile::gdn_chunk_backward", mutates_args=())
def gdn_chunk_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       initial_state: Tensor | None, scale: float, chunk_size: int,
                       backend: str) -> list[Tensor]:
    def forward(q, k, v, g, beta, h0):
        return _chunk(q, k, v, g, beta, h0, scale, chunk_size, backend)

    return _grads_by_recompute(forward, [q, k, v, g, beta, initial_state], [grad_out])


@gdn_chunk_backward.register_fake
def _(grad_out, q, k, v, g, beta, initial_state, scale, chunk_size, backend):
    like = [q, k, v, g, beta]
    state = torch.empty_like(initial_state) if initial_state is not None else q.new_empty(0)
    return [torch.empty_like(x) for x in like] + [state]


def _chunk_setup(ctx, inputs, output):
    q, k, v, g, beta, initial_state, scale, chunk_size, backend = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state)
    ctx.scale, ctx.chunk_size, ctx.backend = scale, chunk_size, backend


def _chunk_grad(ctx, grad_out):
    q, k, v, g, beta, initial_state = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dh0 = gdn_chunk_backward(
        grad_out, q, k, v, g, beta, initial_state, ctx.scale, ctx.chunk_size, ctx.backend
    )
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None, None


gdn_chunk.register_autograd(_chunk_grad, setup_context=_chunk_setup)


# --------------------------------------------------------------------------- gdn_summary


@torch.library.custom_op("cpcompile::gdn_summary", mutates_args=())
def gdn_summary(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int, backend: str) -> tuple[Tensor, Tensor]:
    return _summary(k, v, g, beta, chunk_size, backend)


def _summary_shapes(k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[list[int], list[int], torch.dtype]:
    batch, heads, key_dim, value_dim = k.shape[0], v.shape[2], k.shape[-1], v.shape[-1]
    return [batch, heads, key_dim, key_dim], [batch, heads, key_dim, value_dim], gdn_eager.compute_dtype(k, v, g, beta)


@gdn_summary.register_fake
def _(k, v, g, beta, chunk_size, backend):
    m_shape, s_shape, dtype = _summary_shapes(k, v, g, beta)
    return k.new_empty(m_shape, dtype=dtype), k.new_empty(s_shape, dtype=dtype)


@torch.library.custom_op("cpcompile::gdn_summary_backward", mutates_args=())
def gdn_summary_backward(grad_m: Tensor, grad_s: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         chunk_size: int, backend: str) -> list[Tensor]:
    def forward(k, v, g, beta):
        return _summary(k, v, g, beta, chunk_size, backend)

    return _grads_by_recompute(forward, [k, v, g, beta], [grad_m, grad_s])


@gdn_summary_backward.register_fake
def _(grad_m, grad_s, k, v, g, beta, chunk_size, backend):
    return [torch.empty_like(x) for x in (k, v, g, beta)]


def _summary_setup(ctx, inputs, output):
    k, v, g, beta, chunk_size, backend = inputs
    ctx.save_for_backward(k, v, g, beta)
    ctx.chunk_size, ctx.backend = chunk_size, backend


def _summary_grad(ctx, grad_m, grad_s):
    k, v, g, beta = ctx.saved_tensors
    dk, dv, dg, dbeta = gdn_summary_backward(grad_m, grad_s, k, v, g, beta, ctx.chunk_size, ctx.backend)
    return dk, dv, dg, dbeta, None, None


gdn_summary.register_autograd(_summary_grad, setup_context=_summary_setup)
