"""Graph fragments shared by the SDPA rewrites: collectives along the sequence or heads,
global masks, and emitting the attention call that replaces a core."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx

from .. import collectives as C
from ..context import PassContext
from .find_cores import SDPA, SdpaMatch
from .graph_utils import Emitter, evaluate_node, val
from .sdpa_masks import CAUSAL, classify_local_mask

aten = torch.ops.aten


class CommGroup(NamedTuple):
    """A process group as a rewrite uses it: the name collective ops take, its size, and
    its role ("cp", "cp_ulysses", "cp_ring"), which the dump shows beside each collective."""

    name: str
    size: int
    role: str


def cp_group(ctx: PassContext) -> CommGroup:
    return CommGroup(ctx.group_name, ctx.cp_size, "cp")


def record_collective(ctx: PassContext, op, purpose: str, launch: fx.Node, done: fx.Node, group: CommGroup) -> None:
    label = purpose if group.role == "cp" else f"{purpose} @{group.role}"
    ctx.record(C.collective_kind(op), label, launch, done, group_name=group.name, group_size=group.size)


def all_gather_sequence(emit: Emitter, ctx: PassContext, x: fx.Node, seq_dim: int, purpose: str,
                        group: CommGroup | None = None) -> fx.Node:
    """Gather `x` along `seq_dim` over `group` (default: cp), ranks in order (rank r's block r-th).

    The sequence dim is moved to the front so that all-gather's concatenation along dim 0
    is exactly the group-rank order; the backward of the gather is a reduce-scatter.
    """
    group = group or cp_group(ctx)
    rank = val(x).dim()
    front = [seq_dim] + [d for d in range(rank) if d != seq_dim]
    back = [front.index(d) for d in range(rank)]
    moved = emit(aten.permute.default, x, front)
    contiguous = emit(aten.clone.default, moved, memory_format=torch.contiguous_format)
    launch = emit(C.ALL_GATHER, contiguous, group.size, group.name)
    done = emit(C.WAIT, launch)
    record_collective(ctx, C.ALL_GATHER, purpose, launch, done, group)
    return emit(aten.permute.default, done, back)


def all_to_all(emit: Emitter, ctx: PassContext, x: fx.Node, *, scatter_dim: int, gather_dim: int,
               group: CommGroup, purpose: str) -> fx.Node:
    """Cut `x` into `group.size` equal parts along `scatter_dim`, send part j to group rank j,
    and join the parts received along `gather_dim`, sender j's part j-th.

    `all_to_all_single` exchanges dim-0 blocks, so the part index is moved to the front
    before the exchange and back beside `gather_dim` after it. Its autograd backward is the
    inverse exchange.
    """
    shape = list(val(x).shape)
    n, rank = group.size, len(shape)
    parts = emit(aten.reshape.default, x, shape[:scatter_dim] + [n, shape[scatter_dim] // n] + shape[scatter_dim + 1:])
    front = emit(aten.permute.default, parts, [scatter_dim] + [d for d in range(rank + 1) if d != scatter_dim])
    contiguous = emit(aten.clone.default, front, memory_format=torch.contiguous_format)
    one_part_each = [1] * n
    launch = emit(C.ALL_TO_ALL, contiguous, one_part_each, one_part_each, group.name)
    done = emit(C.WAIT, launch)
    record_collective(ctx, C.ALL_TO_ALL, purpose, launch, done, group)
    # received: [sender, *shape with scatter_dim cut]; put the sender axis just before gather_dim
    beside_gather = list(range(1, gather_dim + 1)) + [0] + list(range(gather_dim + 1, rank + 1))
    placed = emit(aten.permute.default, done, beside_gather)
    out_shape = list(shape)
    out_shape[scatter_dim] //= n
    out_shape[gather_dim] *= n
    return emit(aten.reshape.default, placed, out_shape)


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


def note_once(ctx: PassContext, note: str) -> None:
    """Add a dump note for the region; a region with several cores gets it once."""
    if note not in ctx.notes:
        ctx.notes.append(note)


def local_key_validity(emit: Emitter, gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext) -> tuple[bool, fx.Node]:
    """Whether the core is causal, and its local key validity `[B, 1, S_local]` (bool).

    Without a mask every local key is valid. With one, the real mask is checked to be
    causal∧key-valid or key-valid alone (anything else is refused) and the validity row is
    read off it: under causality only the last query row sees every key.
    """
    query = val(match.query)
    q_len = query.shape[2]
    if match.attn_mask is None:
        return match.is_causal, all_valid_keys(emit, query.shape[0], q_len, query.device)
    if match.is_causal:
        raise ValueError(f"{ctx.fqn}: SDPA with both is_causal=True and a mask is not supported")
    causal = classify_local_mask(evaluate_node(gm, match.attn_mask, ctx.example_inputs), ctx.fqn) == CAUSAL
    return causal, mask_row(emit, match.attn_mask, q_len - 1 if causal else 0)


def visible_keys(emit: Emitter, key_valid: fx.Node, causal: bool, q_len: int, kv_len: int, q_offset: int,
                 device) -> fx.Node:
    """The `[B, 1, q_len, kv_len]` mask of queries at global positions `q_offset + i` against keys
    `0..kv_len-1`: key validity `[B, 1, 1, kv_len]`, and causality when the core is causal."""
    if not causal:
        return key_valid
    return emit(aten.logical_and.default, key_valid, global_causal_mask(emit, q_len, kv_len, q_offset, device))


def emit_attention(emit: Emitter, match: SdpaMatch, query: fx.Node, key: fx.Node, value: fx.Node,
                   attn_mask: fx.Node, enable_gqa: bool) -> fx.Node:
    """A new SDPA call on the given inputs, keeping the core's dropout and scale."""
    return emit(SDPA, query, key, value, attn_mask=attn_mask, dropout_p=match.dropout_p, is_causal=False,
                scale=match.scale, enable_gqa=enable_gqa)


def replace_core(gm: fx.GraphModule, match: SdpaMatch, output: fx.Node) -> None:
    """Make every user of the old SDPA call read `output` instead, and drop the old call.

    Used when the rewritten attention returns a different shape than the core (fewer heads,
    or several calls), so the core node itself cannot simply take new arguments.
    """
    match.node.replace_all_uses_with(output)
    gm.graph.erase_node(match.node)
