"""The custom ops behind `local_attention`, each with a fake implementation and its own backward op.

    chunk_attention(q, k, v, chunk_starts, causal, scale, kernel) -> (out, lse)          # unmasked.py
    tiled_attention(q, k, v, key_tags, chunk_starts, causal, scale, kernel, query_positions?) -> (out, lse)
                                                                                    # tiled.py
    varlen_attention(q, k, v, key_tags, chunk_starts, causal, scale) -> (out, lse)   # varlen.py

Gradients come back contiguous whatever layout the kernels give theirs (flash returns its
gradients as transposed views): K and V come from an all-gather or all-to-all, whose backward
NCCL runs only on contiguous tensors.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import tiled, unmasked, varlen
from .kernels import lse_dtype
from .layout import chunk_length


def _fake_outputs(q: Tensor, chunk_starts: list[int]) -> tuple[Tensor, Tensor]:
    chunk_length(q, chunk_starts)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q))


def _contiguous_like(grads, inputs) -> tuple[Tensor, ...]:
    return tuple(g.to(x.dtype).contiguous() for g, x in zip(grads, inputs))


def _fake_grads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --------------------------------------------------------------------------- chunk_attention


@torch.library.custom_op("cpcompile::chunk_attention", mutates_args=())
def chunk_attention(q: Tensor, k: Tensor, v: Tensor, chunk_starts: list[int], causal: bool, scale: float,
                    kernel: str) -> tuple[Tensor, Tensor]:
    return unmasked.forward(q, k, v, chunk_starts, causal, scale, kernel)


@chunk_attention.register_fake
def _(q, k, v, chunk_starts, causal, scale, kernel):
    return _fake_outputs(q, chunk_starts)


@torch.library.custom_op("cpcompile::chunk_attention_backward", mutates_args=())
def chunk_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             chunk_starts: list[int], causal: bool, scale: float,
                             kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    grads = unmasked.backward(grad_out, q, k, v, out, lse, chunk_starts, causal, scale, kernel)
    return _contiguous_like(grads, (q, k, v))


@chunk_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, chunk_starts, causal, scale, kernel):
    return _fake_grads(q, k, v)


def _chunk_setup(ctx, inputs, output):
    q, k, v, *ctx.config = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.mark_non_differentiable(output[1])


def _chunk_grad(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = chunk_attention_backward(grad_out.contiguous(), q, k, v, out, lse, *ctx.config)
    return dq, dk, dv, None, None, None, None


chunk_attention.register_autograd(_chunk_grad, setup_context=_chunk_setup)


# --------------------------------------------------------------------------- tiled_attention


@torch.library.custom_op("cpcompile::tiled_attention", mutates_args=())
def tiled_attention(q: Tensor, k: Tensor, v: Tensor, key_tags: Tensor, chunk_starts: list[int], causal: bool,
                    scale: float, kernel: str, query_positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return tiled.forward(q, k, v, key_tags, chunk_starts, causal, scale, kernel, query_positions)


@tiled_attention.register_fake
def _(q, k, v, key_tags, chunk_starts, causal, scale, kernel, query_positions=None):
    return _fake_outputs(q, chunk_starts)


@torch.library.custom_op("cpcompile::tiled_attention_backward", mutates_args=())
def tiled_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             key_tags: Tensor, chunk_starts: list[int], causal: bool, scale: float,
                             kernel: str, query_positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    grads = tiled.backward(grad_out, q, k, v, out, lse, key_tags, chunk_starts, causal, scale, kernel,
                           query_positions)
    return _contiguous_like(grads, (q, k, v))


@tiled_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, key_tags, chunk_starts, causal, scale, kernel, query_positions=None):
    return _fake_grads(q, k, v)


def _tiled_setup(ctx, inputs, output):
    q, k, v, key_tags, chunk_starts, causal, scale, kernel, query_positions = inputs
    ctx.config = (chunk_starts, causal, scale, kernel)
    ctx.save_for_backward(q, k, v, key_tags, query_positions, *output)
    ctx.mark_non_differentiable(output[1])


def _tiled_grad(ctx, grad_out, _grad_lse):
    q, k, v, key_tags, query_positions, out, lse = ctx.saved_tensors
    dq, dk, dv = tiled_attention_backward(grad_out.contiguous(), q, k, v, out, lse, key_tags, *ctx.config,
                                          query_positions)
    return dq, dk, dv, None, None, None, None, None, None


tiled_attention.register_autograd(_tiled_grad, setup_context=_tiled_setup)


# --------------------------------------------------------------------------- varlen_attention


@torch.library.custom_op("cpcompile::varlen_attention", mutates_args=())
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, key_tags: Tensor, chunk_starts: list[int], causal: bool,
                     scale: float) -> tuple[Tensor, Tensor]:
    return varlen.forward(q, k, v, key_tags, chunk_starts, causal, scale)


@varlen_attention.register_fake
def _(q, k, v, key_tags, chunk_starts, causal, scale):
    return _fake_outputs(q, chunk_starts)


@torch.library.custom_op("cpcompile::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              key_tags: Tensor, chunk_starts: list[int], causal: bool,
                              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    grads = varlen.backward(grad_out, q, k, v, out, lse, key_tags, chunk_starts, causal, scale)
    return _contiguous_like(grads, (q, k, v))


@varlen_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, key_tags, chunk_starts, causal, scale):
    return _fake_grads(q, k, v)


def _varlen_setup(ctx, inputs, output):
    q, k, v, key_tags, *ctx.config = inputs
    ctx.save_for_backward(q, k, v, key_tags, *output)
    ctx.mark_non_differentiable(output[1])


def _varlen_grad(ctx, grad_out, _grad_lse):
    q, k, v, key_tags, out, lse = ctx.saved_tensors
    dq, dk, dv = varlen_attention_backward(grad_out.contiguous(), q, k, v, out, lse, key_tags, *ctx.config)
    return dq, dk, dv, None, None, None, None


varlen_attention.register_autograd(_varlen_grad, setup_context=_varlen_setup)
