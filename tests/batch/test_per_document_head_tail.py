"""Per-document Head-Tail (`documents.per_document_head_tail`): a packed batch under a Head-Tail
plan is cut document by document, so every rank holds a head and a tail piece of every document.

The order is a permutation with S/cp tokens per rank, each rank's in global order; one document is
plain Head-Tail; the causal work per rank is balanced where plain Head-Tail over the packed row is
not; `shard_batch` marks the local batch with its tokens' global positions and `unshard` restores
the global order from it (and refuses to guess without it).
"""
from __future__ import annotations

import random
import types

import pytest
import torch

from cpcompile.batch import shard_batch, unshard
from cpcompile.documents import GLOBAL_POSITIONS, per_document_head_tail
from cpcompile.errors import CPInputError
from cpcompile.methods import HEAD_TAIL, CPMethod
from cpcompile.plan import AcceleratorConfig, Override, Plan
from cpcompile.sequence_layout import local_indices
from dist_utils import run_distributed


def _plan(cp_size: int) -> Plan:
    method = CPMethod("head_tail", "sdpa", "w", layout=HEAD_TAIL)
    return Plan(AcceleratorConfig(cp_size=cp_size), (Override("*.attn", "cp", False, method=method),))


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def _random_lengths(total: int, rng: random.Random, longest: int) -> list[int]:
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(1, longest), total - sum(lengths)))
    return lengths


def _work(positions: torch.Tensor, tokens: torch.Tensor) -> float:
    """Causal query-key pairs of `tokens` (global indices): a token sees its document up to itself."""
    return float((positions[tokens] + 1).sum())


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_order_is_a_balanced_permutation_in_global_order_per_rank(cp):
    rng = random.Random()
    for _ in range(20):
        lengths = _random_lengths(2 * cp * rng.randint(4, 40), rng, 30)
        positions = _positions(lengths)
        order = per_document_head_tail(positions[None], cp)[0]
        assert torch.equal(order.sort().values, torch.arange(positions.numel())), lengths
        for block in order.view(cp, -1):
            assert bool((block[1:] > block[:-1]).all()), (lengths, block)
        # every document: each rank holds 2 of its 2cp pieces, within one token of 2/(2cp) of it
        starts = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
        rank = torch.empty_like(order)
        rank[order] = torch.arange(cp).repeat_interleave(positions.numel() // cp)
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
            counts = torch.bincount(rank[a:b], minlength=cp)
            assert int(counts.max() - counts.min()) <= 2, (lengths, a, b, counts)


def test_one_document_is_plain_head_tail():
    order = per_document_head_tail(torch.arange(48)[None], 3)[0]
    assert torch.equal(order, torch.cat([local_indices(48, 3, r, HEAD_TAIL) for r in range(3)]))


def test_work_is_balanced_where_plain_head_tail_is_not():
    """One long document among short ones (S = 4096, cp = 4): per document, the busiest rank does
    at most 2% over the mean; plain Head-Tail's busiest rank does over 1.5x."""
    rng = random.Random()
    lengths = [16] * 192
    lengths.insert(rng.randrange(len(lengths)), 1024)
    positions = _positions(lengths)
    cp, size = 4, positions.numel()
    per_document = per_document_head_tail(positions[None], cp)[0].view(cp, -1)
    plain = [local_indices(size, cp, r, HEAD_TAIL) for r in range(cp)]
    for layout, ranks, bound in (("per document", per_document, 1.02), ("plain", plain, None)):
        work = torch.tensor([_work(positions, tokens) for tokens in ranks])
        ratio = float(work.max() / work.mean())
        if bound is not None:
            assert ratio <= bound, (layout, work)
        else:
            assert ratio > 1.5, (layout, work)


def test_a_plan_with_head_tail_gdn_keeps_the_two_chunks_for_a_packed_batch():
    """GDN in Head-Tail order needs the layout's two fixed chunks (its fragments), packed or not:
    beside it, a packed batch is cut like any other (no per-document order, no global positions)."""
    from cpcompile.adapters.qwen3_5 import qwen3_5_gdn_p2p_head_tail_cp_wrapper

    cp, length = 2, 24
    plan = Plan(AcceleratorConfig(cp_size=cp), (*_plan(cp).overrides, Override(
        "*.linear_attn", "cp", False, method=qwen3_5_gdn_p2p_head_tail_cp_wrapper())))
    batch = {"input_ids": torch.randint(0, 50, (1, length)), "position_ids": _positions([1, 9, 3, 11])[None]}
    for rank in range(cp):
        local = shard_batch(batch, types.SimpleNamespace(cp_size=cp, cp_rank=rank), plan)
        assert getattr(local["position_ids"], GLOBAL_POSITIONS, None) is None
        index = local_indices(length, cp, rank, HEAD_TAIL)
        assert torch.equal(local["input_ids"], batch["input_ids"][:, index])
        assert torch.equal(local["position_ids"], batch["position_ids"][:, index])


def test_shard_batch_marks_global_positions_per_row():
    """Two rows with different documents: each row cut by its own documents; the local tokens are
    the global ones at the marked positions."""
    cp, length = 2, 24
    rows = [_positions([1, 9, 3, 11]), _positions([12, 5, 7])]
    batch = {"input_ids": torch.randint(0, 50, (2, length)), "position_ids": torch.stack(rows)}
    batch["labels"] = batch["input_ids"].clone()
    for rank in range(cp):
        local = shard_batch(batch, types.SimpleNamespace(cp_size=cp, cp_rank=rank), _plan(cp))
        where = getattr(local["position_ids"], GLOBAL_POSITIONS)
        assert where.shape == (2, length // cp)
        assert torch.equal(local["input_ids"], batch["input_ids"].gather(1, where))
        assert torch.equal(local["position_ids"], batch["position_ids"].gather(1, where))
        for row in range(2):
            want = per_document_head_tail(rows[row][None], cp)[0].view(cp, -1)[rank]
            assert torch.equal(where[row], want)


def _round_trip(rank: int, world: int, seed: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    mesh = types.SimpleNamespace(cp_size=world, cp_rank=rank, cp=dm, dp_cp=dm)
    rng = random.Random(seed)
    positions = torch.stack([_positions(_random_lengths(8 * world, rng, 9)) for _ in range(2)])
    for row in positions:
        row[0] = 0
    ids = torch.randint(0, 50, (2, 8 * world), generator=torch.Generator().manual_seed(seed))
    local = shard_batch({"input_ids": ids, "position_ids": positions}, mesh, _plan(world))
    values = local["input_ids"].float().requires_grad_()
    restored = unshard(values, mesh, _plan(world), batch=local)
    assert torch.equal(restored, ids.float())
    restored.sum().backward()  # every rank's sum reads this rank's tokens once
    assert torch.equal(values.grad, torch.full_like(values, world))
    with pytest.raises(CPInputError, match="pass the local batch"):
        unshard(local["input_ids"], mesh, _plan(world))
    plain = shard_batch({"input_ids": ids}, mesh, _plan(world))  # a plain Head-Tail batch: no batch needed
    assert torch.equal(unshard(plain["input_ids"], mesh, _plan(world)), ids)


@pytest.mark.parametrize("world", [2, 4])
def test_unshard_restores_a_batch_cut_per_document(world):
    run_distributed(_round_trip, world, random.randrange(1 << 30))
