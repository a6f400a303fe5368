"""Graph fragments shared by the SDPA rewrites: gathering along the sequence, global masks."""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import collectives as C
from ..context import PassContext
from .graph_utils import Emitter, val

aten = torch.ops.aten


def all_gather_sequence(emit: Emitter, ctx: PassContext, x: fx.Node, seq_dim: int, purpose: str) -> fx.Node:
    """Gather `x` along `seq_dim` over the cp group, ranks in order (rank r's block r-th).

    The sequence dim is moved to the front so that all-gather's concatenation along dim 0
    is exactly the global sequence order; the backward of the gather is a reduce-scatter.
    """
    rank = val(x).dim()
    front = [seq_dim] + [d for d in range(rank) if d != seq_dim]
    back = [front.index(d) for d in range(rank)]
    moved = emit(aten.permute.default, x, front)
    contiguous = emit(aten.clone.default, moved, memory_format=torch.contiguous_format)
    launch = emit(C.ALL_GATHER, contiguous, ctx.cp_size, ctx.group_name)
    done = emit(C.WAIT, launch)
    ctx.record(C.collective_kind(C.ALL_GATHER), purpose, launch, done)
    return emit(aten.permute.default, done, back)


def global_causal_mask(emit: Emitter, q_len: int, kv_len: int, q_offset: int, device) -> fx.Node:
    """`[q_len, kv_len]` boolean mask: query i (global index q_offset+i) sees keys j ≤ it."""
    q_pos = emit(aten.arange.start, q_offset, q_offset + q_len, device=device)
    k_pos = emit(aten.arange.default, kv_len, device=device)
    return emit(aten.le.Tensor, emit(aten.unsqueeze.default, k_pos, 0), emit(aten.unsqueeze.default, q_pos, 1))


def mask_row(emit: Emitter, local_mask: fx.Node, row: int) -> fx.Node:
    """Key validity `[B, 1, S_local]` read off one query row of a local `[B, H, Sq, Sk]` mask."""
    first_head = emit(aten.slice.Tensor, local_mask, 1, 0, 1)
    return emit(aten.select.int, first_head, 2, row)


def all_valid_keys(emit: Emitter, batch: int, length: int, device) -> fx.Node:
    return emit(aten.ones.default, [batch, 1, length], dtype=torch.bool, device=device)


def gathered_key_valid(emit: Emitter, ctx: PassContext, key_valid: fx.Node) -> fx.Node:
    """Gather local key validity `[B, 1, S_local]` into `[B, 1, 1, S_global]` (bool)."""
    as_bytes = emit(aten._to_copy.default, key_valid, dtype=torch.uint8)  # gloo has no bool
    gathered = all_gather_sequence(emit, ctx, as_bytes, seq_dim=2, purpose="key padding mask")
    as_bool = emit(aten.ne.Scalar, gathered, 0)
    return emit(aten.unsqueeze.default, as_bool, 2)
