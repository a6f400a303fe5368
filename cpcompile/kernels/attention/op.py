"""`cpcompile::chunk_attention`: the one local-attention op the SDPA CP rewrites emit.

    chunk_attention(q, k, v, key_valid, chunk_starts, causal, scale, kernel, masked_kernel) -> (out, lse)

`q [B, Hq, n·c, D]` holds n equal chunks of queries; chunk i sits at global positions
`[chunk_starts[i], chunk_starts[i] + c)` (AllGather: one chunk at r·S_local; Head-Tail: chunks r
and 2·cp−1−r; Ulysses: one chunk at 0 spanning the sequence; Hybrid: one chunk spanning its
Ulysses group). `k, v [B, Hkv, S_kv, D]` are in global order; `key_valid [B, S_kv]` (bool) marks
real keys. A query at position p sees key j when `key_valid[b, j]` and, if `causal`, j ≤ p.

Every rank gathers key validity, since a rank whose own tokens are unpadded still attends to other
ranks' padding. The op reads back whether any key is padded (one flag per call) and runs the
unmasked blocks on `kernel` if none is, the masked tiles on `masked_kernel` otherwise; the backward
takes the same branch. Gradients come back contiguous whatever the kernels give: K and V come from
an all-gather or all-to-all, whose backward NCCL runs only on contiguous tensors.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import tiled, unmasked
from .kernels import lse_dtype
from .layout import chunk_length


def _any_padding(key_valid: Tensor) -> bool:
    return not bool(key_valid.all())


@torch.library.custom_op("cpcompile::chunk_attention", mutates_args=())
def chunk_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, chunk_starts: list[int], causal: bool,
                    scale: float, kernel: str, masked_kernel: str) -> tuple[Tensor, Tensor]:
    if _any_padding(key_valid):
        return tiled.forward(q, k, v, key_valid, chunk_starts, causal, scale, masked_kernel)
    return unmasked.forward(q, k, v, chunk_starts, causal, scale, kernel)


@chunk_attention.register_fake
def _(q, k, v, key_valid, chunk_starts, causal, scale, kernel, masked_kernel):
    chunk_length(q, chunk_starts)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q))


@torch.library.custom_op("cpcompile::chunk_attention_backward", mutates_args=())
def chunk_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             key_valid: Tensor, chunk_starts: list[int], causal: bool, scale: float, kernel: str,
                             masked_kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    if _any_padding(key_valid):
        grads = tiled.backward(grad_out, q, k, v, out, lse, key_valid, chunk_starts, causal, scale, masked_kernel)
    else:
        grads = unmasked.backward(grad_out, q, k, v, out, lse, chunk_starts, causal, scale, kernel)
    return tuple(g.to(x.dtype).contiguous() for g, x in zip(grads, (q, k, v)))


@chunk_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, key_valid, chunk_starts, causal, scale, kernel, masked_kernel):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, key_valid, *ctx.config = inputs
    ctx.save_for_backward(q, k, v, key_valid, *output)
    ctx.mark_non_differentiable(output[1])


def _grad(ctx, grad_out, _grad_lse):
    q, k, v, key_valid, out, lse = ctx.saved_tensors
    dq, dk, dv = chunk_attention_backward(grad_out.contiguous(), q, k, v, out, lse, key_valid, *ctx.config)
    return dq, dk, dv, None, None, None, None, None, None


chunk_attention.register_autograd(_grad, setup_context=_setup)
