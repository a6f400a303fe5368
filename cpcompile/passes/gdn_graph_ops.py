"""Graph fragments for GDN CP: pass-to-next-rank, sequence↔head exchange, summary algebra.

Token tensors here use the GDN layout `[B, T, H, *rest]` (sequence dim 1, head dim 2).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import collectives as C
from ..context import PassContext
from .graph_utils import Emitter, val
from .sequence_ops import all_gather_sequence, all_to_all, cp_group, record_collective

aten = torch.ops.aten
SEQ, HEADS = 1, 2


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
    record_collective(ctx, C.ALL_TO_ALL, purpose, launch, received, cp_group(ctx))
    if rank > 0:
        return received
    # zeros that still depend on `received` (so its backward runs), without 0·inf = NaN
    no = emit(aten.zeros.default, [], dtype=torch.bool, device=val(received).device)
    return emit(aten.where.ScalarOther, no, received, 0.0)


def seq_to_heads(emit: Emitter, ctx: PassContext, x: fx.Node, purpose: str) -> fx.Node:
    """`[B, T/P, H, *rest]` on every rank → `[B, T, H/P, *rest]` (rank r keeps head block r)."""
    return all_to_all(emit, ctx, x, scatter_dim=HEADS, gather_dim=SEQ, group=cp_group(ctx), purpose=purpose)


def heads_to_seq(emit: Emitter, ctx: PassContext, x: fx.Node, purpose: str) -> fx.Node:
    """Inverse of `seq_to_heads`: `[B, T, H/P, *rest]` → `[B, T/P, H, *rest]`."""
    return all_to_all(emit, ctx, x, scatter_dim=SEQ, gather_dim=HEADS, group=cp_group(ctx), purpose=purpose)


def gather_ranks(emit: Emitter, ctx: PassContext, x: fx.Node, purpose: str) -> fx.Node:
    """`[...]` on every rank → `[P, ...]` in rank order."""
    return all_gather_sequence(emit, ctx, emit(aten.unsqueeze.default, x, 0), seq_dim=0, purpose=purpose)


def apply_summary(emit: Emitter, m: fx.Node, s: fx.Node, state: fx.Node) -> fx.Node:
    """`M @ H + S`: a segment's effect on the state entering it."""
    return emit(aten.add.Tensor, emit(aten.matmul.default, m, state), s)


def summary_parts(emit: Emitter, summary: fx.Node) -> tuple[fx.Node, fx.Node]:
    return emit(operator.getitem, summary, 0), emit(operator.getitem, summary, 1)
