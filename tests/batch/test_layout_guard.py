"""`shard_batch` marks the layout it sliced for, and `LayoutGuard` (what a compiled model checks
before each call) compares it, or, for an unmarked batch, the position ids' values (issue 12, item 3)."""
from __future__ import annotations

import types

import pytest
import torch

from cpcompile import CPInputError
from cpcompile.batch import shard_batch
from cpcompile.methods import CONTIGUOUS, HEAD_TAIL, CPMethod
from cpcompile.plan import AcceleratorConfig, Override, Plan
from cpcompile.sequence_layout import LayoutGuard


def _local(layout: str, cp_rank: int, seq_len: int = 16) -> dict:
    method = CPMethod("m", "sdpa", "w", layout=layout)
    plan = Plan(AcceleratorConfig(cp_size=2), (Override(match="attn", when="cp", region_dispatch=False, method=method),))
    mesh = types.SimpleNamespace(cp_size=2, cp_rank=cp_rank)
    return shard_batch({"input_ids": torch.randint(0, 11, (2, seq_len))}, mesh, plan)


@pytest.mark.parametrize("layout", [CONTIGUOUS, HEAD_TAIL])
def test_a_marked_batch_passes_only_its_own_layout_and_rank(layout):
    positions = _local(layout, cp_rank=1)["position_ids"]
    LayoutGuard(2, 1, layout).check(positions)
    other = HEAD_TAIL if layout == CONTIGUOUS else CONTIGUOUS
    with pytest.raises(CPInputError, match=f"sharded for the '{layout}' layout, cp rank 1 of 2.*'{other}' layout"):
        LayoutGuard(2, 1, other).check(positions)
    with pytest.raises(CPInputError, match="cp rank 1 of 2, but this model was compiled for .* cp rank 0 of 2"):
        LayoutGuard(2, 0, layout).check(positions)


@pytest.mark.parametrize("layout", [CONTIGUOUS, HEAD_TAIL])
def test_unmarked_positions_are_checked_by_value(layout):
    copied = _local(layout, cp_rank=1)["position_ids"].clone()  # a copy loses the mark
    LayoutGuard(2, 1, layout).check(copied)
    other = HEAD_TAIL if layout == CONTIGUOUS else CONTIGUOUS
    with pytest.raises(CPInputError, match=f"not this rank's slice .* under the plan's '{other}' layout"):
        LayoutGuard(2, 1, other).check(copied)


def test_global_positions_fed_to_a_later_rank_are_refused():
    with pytest.raises(CPInputError, match="cp rank 1 .* would start at 16"):
        LayoutGuard(2, 1, CONTIGUOUS).check(torch.arange(16)[None])


def test_values_are_read_once_per_shape():
    guard = LayoutGuard(2, 0, CONTIGUOUS)
    guard.check(torch.arange(8)[None])
    guard.check(torch.arange(8, 16)[None])  # the same shape again: not read back (a sync per step)
    with pytest.raises(CPInputError):
        guard.check(torch.arange(8, 18)[None])


def test_position_ids_are_required():
    with pytest.raises(CPInputError, match="without position_ids"):
        LayoutGuard(2, 0, CONTIGUOUS).check(None)


def test_models_reading_documents_check_unmarked_values_on_every_call():
    """A GDN model reads packing off the mark: an unmarked packed batch must never pass as one document."""
    guard = LayoutGuard(2, 0, CONTIGUOUS, every_call=True)
    guard.check(torch.arange(8)[None])
    with pytest.raises(CPInputError, match="not this rank's slice"):
        guard.check(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))  # packed, the same shape, mark lost


def test_the_document_feed_passes_only_marked_packed_positions():
    from cpcompile.documents import DocumentFeed, mark_packed

    feed, packed, plain = DocumentFeed(), torch.tensor([[0, 1, 0, 1]]), torch.arange(4)[None]
    mark_packed(packed, True)
    mark_packed(plain, False)
    for positions, expected in ((packed, packed), (plain, None), (packed.clone(), None), (None, None)):
        feed.update(positions)
        assert feed.positions is expected
