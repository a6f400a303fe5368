"""Graph fragments for GDN CP: pass-to-next-rank, sequence↔head all-to-all, summary algebra.

Token tensors here use the GDN layout `[B, T, H, *rest]` (sequence dim 1, head dim 2).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import collectives as C
from ..context import PassContext
from .graph_utils import Emitter, val

aten = torch.ops.aten


def shift_to_next_rank(emit: Emitter, ctx: PassContext, rows: fx.Node, purpose: str) -> fx.Node:
    """Send `rows` (`[n, ...]`) to rank r+1 and receive rank r−1's; rank 0 gets zeros.

    One all-to-all on a ring: every rank sends exactly one payload, to (r+1) mod P. Rank 0 has
    no predecessor, so it zeroes what the last rank sent; it still uses it, so the collective
    and its backward (which returns each gradient to its sender) run alike on every rank —
    and no rank ever sends an empty buffer.
    """
    rank, size = ctx.cp_rank, ctx.cp_size
    count = val(rows).shape[0]
    send_splits = [count if peer == (rank + 1) % size else 0 for peer in range(size)]
    recv_splits = [count if peer == (rank - 1) % size else 0 for peer in range(size)]
    payload = emit(aten.clone.default, rows, memory_format=torch.contiguous_format)
    launch = emit(C.ALL_TO_ALL, payload, recv_splits, send_splits, ctx.group_name)
    received = emit(C.WAIT, launch)
    ctx.record(C.collective_kind(C.ALL_TO_ALL), purpose, launch, received)
    return received if rank > 0 else emit(aten.mul.Scalar, received, 0)


def seq_to_heads(emit: Emitter, ctx: PassContext, x: fx.Node, purpose: str) -> fx.Node:
    """`[B, T/P, H, *rest]` on every rank → `[B, T, H/P, *rest]` (rank r keeps head block r)."""
    size = ctx.cp_size
    shape = list(val(x).shape)
    batch, local_len, heads, rest = shape[0], shape[1], shape[2], shape[3:]
    split = emit(aten.reshape.default, x, [batch, local_len, size, heads // size, *rest])
    dims = list(range(len(rest) + 4))
    to_front = emit(aten.permute.default, split, [2, 0, 1, *dims[3:]])  # [P, B, T/P, H/P, *rest]
    received = all_to_all_blocks(emit, ctx, to_front, purpose)  # block i: sequence block of rank i
    back = emit(aten.permute.default, received, [1, 0, 2, *dims[3:]])
    return emit(aten.reshape.default, back, [batch, local_len * size, heads // size, *rest])


def heads_to_seq(emit: Emitter, ctx: PassContext, x: fx.Node, purpose: str) -> fx.Node:
    """Inverse of `seq_to_heads`: `[B, T, H/P, *rest]` → `[B, T/P, H, *rest]`."""
    size = ctx.cp_size
    shape = list(val(x).shape)
    batch, length, head_block, rest = shape[0], shape[1], shape[2], shape[3:]
    split = emit(aten.reshape.default, x, [batch, size, length // size, head_block, *rest])
    dims = list(range(len(rest) + 4))
    to_front = emit(aten.permute.default, split, [1, 0, *dims[2:]])  # [P, B, T/P, H/P, *rest]
    received = all_to_all_blocks(emit, ctx, to_front, purpose)  # block i: head block of rank i
    back = emit(aten.permute.default, received, [1, 2, 0, *dims[3:]])
    return emit(aten.reshape.default, back, [batch, length // size, head_block * size, *rest])


def all_to_all_blocks(emit: Emitter, ctx: PassContext, blocks: fx.Node, purpose: str) -> fx.Node:
    """Exchange block i of dim 0 with rank i (equal blocks)."""
    contiguous = emit(aten.clone.default, blocks, memory_format=torch.contiguous_format)
    splits = [1] * ctx.cp_size
    launch = emit(C.ALL_TO_ALL, contiguous, splits, splits, ctx.group_name)
    done = emit(C.WAIT, launch)
    ctx.record(C.collective_kind(C.ALL_TO_ALL), purpose, launch, done)
    return done


def apply_summary(emit: Emitter, m: fx.Node, s: fx.Node, state: fx.Node) -> fx.Node:
    """`M @ H + S`: a segment's effect on the state entering it."""
    return emit(aten.add.Tensor, emit(aten.matmul.default, m, state), s)


def summary_parts(emit: Emitter, summary: fx.Node) -> tuple[fx.Node, fx.Node]:
    return emit(operator.getitem, summary, 0), emit(operator.getitem, summary, 1)
