"""How a CP sequence layout cuts one global sequence over the cp ranks, and the check that a call is
this rank's slice of it.

- `local_indices`: the global token indices a rank holds (contiguous: one block; Head-Tail: chunks
  r and 2·cp−1−r); `required_multiple`: the length each layout needs; `reorder_for_layout` /
  `restore_order`: global order to rank-major order (what an all-gather concatenates) and back.
- `mark_layout` / `LayoutGuard`: `shard_batch` marks the local position ids with the slice they
  are; a compiled model checks every call's position ids against its own slice (docs/batch.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import CPInputError
from .methods import CONTIGUOUS, HEAD_TAIL


def required_multiple(layout: str, cp_size: int) -> int:
    """The sequence length must be a multiple of this for `layout` over `cp_size` ranks."""
    if layout == CONTIGUOUS:
        return cp_size
    if layout == HEAD_TAIL:
        return 2 * cp_size
    raise CPInputError(f"unknown sequence layout {layout!r}; expected {CONTIGUOUS!r} or {HEAD_TAIL!r}")


def local_indices(seq_len: int, cp_size: int, cp_rank: int, layout: str) -> torch.Tensor:
    """Global token indices (LongTensor, in local order) held by `cp_rank`.

    contiguous: block `cp_rank` of `cp_size` equal blocks.
    head_tail:  chunks `cp_rank` and `2*cp_size-1-cp_rank` of `2*cp_size` equal chunks, in that
    order, so every rank gets one early (cheap) and one late (expensive) causal chunk.
    """
    multiple = required_multiple(layout, cp_size)
    if seq_len % multiple:
        raise CPInputError(f"sequence length {seq_len} is not a multiple of {multiple} ({layout}, cp={cp_size})")
    if not 0 <= cp_rank < cp_size:
        raise CPInputError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")
    chunk = seq_len // multiple
    if layout == CONTIGUOUS:
        return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk), torch.arange(tail * chunk, (tail + 1) * chunk)])


def _rank_major_order(seq_len: int, cp_size: int, layout: str) -> torch.Tensor:
    """Global indices in the order an all-gather over ranks 0..cp-1 concatenates them."""
    return torch.cat([local_indices(seq_len, cp_size, r, layout) for r in range(cp_size)])


def reorder_for_layout(tensor: torch.Tensor, cp_size: int, layout: str, *, seq_dim: int = 1) -> torch.Tensor:
    """Global order -> rank-major order (rank 0's tokens, then rank 1's, ...)."""
    if cp_size == 1 or layout == CONTIGUOUS:
        return tensor
    order = _rank_major_order(tensor.shape[seq_dim], cp_size, layout).to(tensor.device)
    return tensor.index_select(seq_dim, order)


def restore_order(tensor: torch.Tensor, cp_size: int, layout: str, *, seq_dim: int = 1) -> torch.Tensor:
    """Rank-major order (as gathered from ranks 0..cp-1) -> global order. Inverse of `reorder_for_layout`."""
    if cp_size == 1 or layout == CONTIGUOUS:
        return tensor
    order = _rank_major_order(tensor.shape[seq_dim], cp_size, layout)
    return tensor.index_select(seq_dim, torch.argsort(order).to(tensor.device))


LAYOUT_MARK = "_cpcompile_layout"  # the attribute `shard_batch` sets on the local position ids


class ShardLayout(NamedTuple):
    layout: str
    cp_size: int
    cp_rank: int

    def describe(self) -> str:
        return f"the {self.layout!r} layout, cp rank {self.cp_rank} of {self.cp_size}"


def mark_layout(position_ids: torch.Tensor, layout: ShardLayout) -> None:
    """Record on the local position ids (a tensor `shard_batch` made) which slice they are, so the
    compiled model can check it on every call at no cost. A copy (`.to(device)`, `.clone()`)
    drops the mark; the model then checks the values instead (`LayoutGuard`)."""
    setattr(position_ids, LAYOUT_MARK, layout)


class LayoutGuard:
    """What a compiled model checks before each call: that its `position_ids` are this rank's
    slice of the global sequence under the plan's layout.

    A batch from `shard_batch` carries the layout it was sliced for (`mark_layout`): compared on
    every call, free. An unmarked one (sliced by hand, or copied) must hold the default global
    positions of this rank's tokens; that costs reading the first row back, so it is checked once
    per position-id shape. Without position ids the model would number every rank's tokens from
    0, so they are required. This catches a global batch fed to every rank (on all ranks but
    the first, whose slice starts at 0 as well) and a batch sliced for another layout or rank.

    A model whose regions read the documents from the position ids' mark (GDN: `documents.DocumentFeed`)
    checks unmarked position ids on every call (`every_call`): one flag read back from the device,
    so that a packed batch that lost its mark is refused, never run as one document.
    """

    def __init__(self, cp_size: int, cp_rank: int, layout: str, *, every_call: bool = False):
        self.expected = ShardLayout(layout, cp_size, cp_rank)
        self.every_call = every_call
        self.checked_shapes: set[tuple[int, ...]] = set()

    def check(self, position_ids: torch.Tensor | None) -> None:
        if position_ids is None:
            raise CPInputError(
                "the CP model was called without position_ids: it would number each rank's tokens from 0. "
                "Pass the global batch through cpcompile.shard_batch, which gives every rank its slice "
                "with global position ids"
            )
        mark = getattr(position_ids, LAYOUT_MARK, None)
        if mark is not None:
            if mark != self.expected:
                raise CPInputError(
                    f"the batch was sharded for {mark.describe()}, but this model was compiled for "
                    f"{self.expected.describe()}: shard it with the plan and mesh the model was compiled with"
                )
            return
        if self.every_call or tuple(position_ids.shape) not in self.checked_shapes:
            self._check_values(position_ids)
            self.checked_shapes.add(tuple(position_ids.shape))

    def _check_values(self, position_ids: torch.Tensor) -> None:
        layout, cp_size, cp_rank = self.expected
        local_len = position_ids.shape[-1]
        expected = local_indices(local_len * cp_size, cp_size, cp_rank, layout)
        first_row = position_ids.reshape(-1, local_len)[0].cpu()
        if not torch.equal(first_row, expected.to(first_row.dtype)):
            raise CPInputError(
                f"position_ids on cp rank {cp_rank} ({_ends(first_row)}) are not this rank's slice of the global "
                f"sequence under the plan's {layout!r} layout, which would start at {int(expected[0])} "
                f"({_ends(expected)}): was the global batch fed to every rank, or sliced for another layout? "
                "Pass it through cpcompile.shard_batch (which also marks the slice, so any position ids pass)"
            )


def _ends(positions: torch.Tensor) -> str:
    values = positions.tolist()
    return f"{values[0]}..{values[-1]}" if len(values) <= 2 else f"{values[0]}, {values[1]}, ..., {values[-1]}"
