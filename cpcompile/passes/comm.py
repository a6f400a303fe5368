"""Communication fragments every rewrite uses, whatever its core: a collective emitted as a launch
node and a wait node, recorded for the dump. SDPA (`sdpa/`) and GDN (`gdn/`) build on these.

- `all_gather_sequence`: gather along one dim over a group, ranks in order (backward: reduce-scatter);
- `all_to_all`: cut along one dim, exchange, join along another (backward: the inverse exchange);
- `shift_to_next_rank`: rank r's rows to rank r+1 (rank 0 gets zeros), one ring all-to-all;
- `shift_to_previous_rank`: rank r's rows to rank r−1 (the last rank keeps a value of its own);
- `exchange_with_neighbours`: rows to rank r+1 and other rows to rank r−1, one all-to-all;
- `gather_ranks`: a tensor from every rank, stacked in rank order.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx

from .. import collectives as C
from ..context import PassContext
from .graph_utils import Emitter, val

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


def collective(emit: Emitter, ctx: PassContext, op, payload: fx.Node, *args, purpose: str,
               group: CommGroup) -> fx.Node:
    """Launch `op` on `payload` (contiguous), wait, record it; the result hands its backward a
    contiguous gradient (`collectives.contiguous_gradient`: NCCL refuses anything else), which
    `CPCOMPILE_STRICT_COLLECTIVES=1` also checks before it reaches the collective."""
    if not val(payload).is_contiguous():
        raise AssertionError(f"{ctx.fqn}: {purpose}: a collective's input must be contiguous")
    launch = emit(op, payload, *args, group.name)
    done = emit(C.WAIT, launch)
    record_collective(ctx, op, purpose, launch, done, group)
    if C.strict_collectives():
        done = emit(C.check_gradient_layout, done, f"{C.collective_kind(op)}({purpose})")
    return emit(C.contiguous_gradient, done)


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
    done = collective(emit, ctx, C.ALL_GATHER, contiguous, group.size, purpose=purpose, group=group)
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
    done = collective(emit, ctx, C.ALL_TO_ALL, contiguous, one_part_each, one_part_each, purpose=purpose, group=group)
    # received: [sender, *shape with scatter_dim cut]; put the sender axis just before gather_dim
    beside_gather = list(range(1, gather_dim + 1)) + [0] + list(range(gather_dim + 1, rank + 1))
    placed = emit(aten.permute.default, done, beside_gather)
    out_shape = list(shape)
    out_shape[scatter_dim] //= n
    out_shape[gather_dim] *= n
    return emit(aten.reshape.default, placed, out_shape)


def shift_to_next_rank(emit: Emitter, ctx: PassContext, rows: fx.Node, purpose: str) -> fx.Node:
    """Send `rows` (`[n, ...]`) to rank r+1 and receive rank r−1's; rank 0 gets zeros.

    One all-to-all on a ring: every rank sends exactly one payload, to (r+1) mod P. Rank 0 has
    no predecessor, so it zeroes what the last rank sent; it still uses it, so the collective
    and its backward (which returns each gradient to its sender) run alike on every rank —
    and no rank ever sends an empty buffer.
    """
    received = _ring_shift(emit, ctx, rows, +1, purpose)
    if ctx.cp_rank > 0:
        return received
    return _instead_of(emit, received, 0.0)


def shift_to_previous_rank(emit: Emitter, ctx: PassContext, rows: fx.Node, purpose: str,
                           last_keeps: fx.Node) -> fx.Node:
    """Send `rows` (`[n, ...]`) to rank r−1 and receive rank r+1's; the last rank, which has no
    successor, takes `last_keeps` (shaped like `rows`) instead of what rank 0 sent it round the
    ring, while still depending on it (as `shift_to_next_rank` does on rank 0)."""
    received = _ring_shift(emit, ctx, rows, -1, purpose)
    if ctx.cp_rank < ctx.cp_size - 1:
        return received
    return _instead_of(emit, received, last_keeps)


def _ring_shift(emit: Emitter, ctx: PassContext, rows: fx.Node, offset: int, purpose: str) -> fx.Node:
    """One all-to-all on the ring: `rows` to rank (r + offset) mod P, rank (r − offset)'s received."""
    rank, size = ctx.cp_rank, ctx.cp_size
    count = val(rows).shape[0]
    send_splits = [count if peer == (rank + offset) % size else 0 for peer in range(size)]
    recv_splits = [count if peer == (rank - offset) % size else 0 for peer in range(size)]
    payload = emit(aten.clone.default, rows, memory_format=torch.contiguous_format)
    return collective(emit, ctx, C.ALL_TO_ALL, payload, recv_splits, send_splits, purpose=purpose,
                      group=cp_group(ctx))


def _instead_of(emit: Emitter, received: fx.Node, value) -> fx.Node:
    """`value` in place of `received`, still depending on it (so its backward runs on this rank
    too), without 0·inf = NaN."""
    no = emit(aten.zeros.default, [], dtype=torch.bool, device=val(received).device)
    if isinstance(value, fx.Node):
        return emit(aten.where.self, no, received, value)
    return emit(aten.where.ScalarOther, no, received, value)


def exchange_with_neighbours(emit: Emitter, ctx: PassContext, to_next: fx.Node, to_previous: fx.Node,
                             purpose: str) -> tuple[fx.Node, fx.Node]:
    """Send `to_next` to rank r+1 and `to_previous` to rank r−1 (both `[n, ...]`, around the ring),
    in one all-to-all -> (what rank r−1 sent to its next, what rank r+1 sent to its previous).

    At the ring's ends the values come round from the other end; the caller decides what rank 0
    and rank P−1 use instead. With two ranks both neighbours are the same rank: it receives one
    block, the rows for its next first.
    """
    rank, size = ctx.cp_rank, ctx.cp_size
    count = val(to_next).shape[0]
    nxt, previous = (rank + 1) % size, (rank - 1) % size
    splits = [count * ((peer == nxt) + (peer == previous)) for peer in range(size)]
    # all_to_all_single sends and receives blocks in peer order; one peer twice (two ranks): next first
    if nxt == previous or nxt < previous:
        blocks, first_from_previous = [to_next, to_previous], nxt == previous
    else:
        blocks, first_from_previous = [to_previous, to_next], True
    payload = emit(aten.cat.default, blocks)
    received = collective(emit, ctx, C.ALL_TO_ALL, payload, splits, splits, purpose=purpose, group=cp_group(ctx))
    first = emit(aten.slice.Tensor, received, 0, 0, count)
    second = emit(aten.slice.Tensor, received, 0, count, 2 * count)
    return (first, second) if first_from_previous else (second, first)


def gather_ranks(emit: Emitter, ctx: PassContext, x: fx.Node, purpose: str) -> fx.Node:
    """`[...]` on every rank → `[P, ...]` in rank order."""
    return all_gather_sequence(emit, ctx, emit(aten.unsqueeze.default, x, 0), seq_dim=0, purpose=purpose)


def note_once(ctx: PassContext, note: str) -> None:
    """Add a dump note for the region; a region with several cores gets it once."""
    if note not in ctx.notes:
        ctx.notes.append(note)
