"""The GDN layer's causal depthwise conv (+ SiLU) on Triton kernels, as a `cpcompile::` custom op:

    gdn_conv(x, weight, bias?, positions?, silu, halo) -> y [B, T, C]        (kernels: `triton/conv.py`)

`x [B, L, C]` is token-major, the layout the layer's projection writes (any strides). With `halo`
its first K − 1 tokens are the left context (`conv.causal_conv`'s `history` contract, transposed:
zeros or a CP rank's halo) and T = L − K + 1; without, T = L and the left context is zeros (no
padded copy). `positions [B, T]` stop each output at its document's start, as `conv.conv_taps`.
The output is contiguous in x's dtype: SiLU applied when `silu`, the taps summed in fp32.

The backward op returns dx (x's shape, halo rows included), dw `[C, 1, K]` and db (or empty), dw
and db summed in fp32. Both have fake implementations, so the op traces as one node; the eager
layer calls it (`conv.conv_silu_tokens`, `conv.causal_conv`), compiled layers keep `conv_taps`.
Triton is imported at the first real call only.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...errors import CPInputError
from ..precision import without_autocast


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor | None, halo: bool) -> int:
    """-> T, the output length; one-line errors on metadata (safe on fake tensors)."""
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[1] != 1 or weight.shape[0] != x.shape[2]:
        raise CPInputError(f"cpcompile::gdn_conv takes x [B, L, C] and a depthwise weight [C, 1, K]; got x "
                           f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[2],):
        raise CPInputError(f"cpcompile::gdn_conv: bias {tuple(bias.shape)} is not [C] = [{x.shape[2]}]")
    length = x.shape[1] - (weight.shape[-1] - 1 if halo else 0)
    if length < 1:
        raise CPInputError(f"cpcompile::gdn_conv: {x.shape[1]} tokens hold no output after the "
                           f"{weight.shape[-1] - 1}-token left context")
    if positions is not None and (tuple(positions.shape) != (x.shape[0], length) or positions.is_floating_point()):
        raise CPInputError(f"cpcompile::gdn_conv: positions must be integer [B, T] = {(x.shape[0], length)}; got "
                           f"{positions.dtype} {tuple(positions.shape)}")
    return length


def _kernels():
    from .triton.capability import check_device
    from .triton import conv

    return check_device, conv


@torch.library.custom_op("cpcompile::gdn_conv", mutates_args=())
def gdn_conv(x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor | None, silu: bool,
             halo: bool) -> Tensor:
    _check(x, weight, bias, positions, halo)
    check_device, conv = _kernels()
    check_device(x.device.type, x.device.index)
    return without_autocast(conv.conv_fwd)(x, weight, bias, positions, silu, halo)


@gdn_conv.register_fake
def _(x, weight, bias, positions, silu, halo):
    return x.new_empty(x.shape[0], _check(x, weight, bias, positions, halo), x.shape[2])


@torch.library.custom_op("cpcompile::gdn_conv_backward", mutates_args=())
def gdn_conv_backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor | None,
                      silu: bool, halo: bool) -> list[Tensor]:
    check_device, conv = _kernels()
    check_device(x.device.type, x.device.index)
    dx, dw, db = without_autocast(conv.conv_bwd)(grad_out, x, weight, bias, positions, silu, halo)
    return [dx, dw, db if db is not None else x.new_empty(0)]


@gdn_conv_backward.register_fake
def _(grad_out, x, weight, bias, positions, silu, halo):
    return [x.new_empty(x.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else x.new_empty(0)]


def _setup(ctx, inputs, output):
    x, weight, bias, positions, ctx.silu, ctx.halo = inputs
    ctx.save_for_backward(x, weight, bias, positions)


def _grad(ctx, grad_out):
    x, weight, bias, positions = ctx.saved_tensors
    dx, dw, db = gdn_conv_backward(grad_out, x, weight, bias, positions, ctx.silu, ctx.halo)
    return dx, dw, (db if bias is not None else None), None, None, None


gdn_conv.register_autograd(_grad, setup_context=_setup)
