"""Ranks that disagree are refused before anything runs wrong (issue 12, item 3).

Before: AllGather on one rank and Ulysses on another hung; AllGather against Head-Tail, a global
batch fed to every rank and a Head-Tail batch fed to an AllGather model gave wrong numbers;
different sequence lengths per rank aborted inside gloo. Now:

- `compile` all-gathers a digest of the plan (cp size, layout, each region's method, the regions'
  parameter shapes) over the cp group before its first collective, and each region a digest of
  its input signature whenever it meets one it has not agreed on (at compile and at re-traces):
  a mismatch raises on every rank, naming what differs and each rank's value;
- the compiled model checks each call's `position_ids` against the plan's layout and this rank:
  the layout `shard_batch` marks on them, or, unmarked, their values (once per shape).

Refusals agree (issue 30, item 1): a check that reads one rank's own data (here the document
mask transformers builds on the one rank whose slice holds a document start, when a packed batch
lacks shard_batch's all-ones mask) used to raise on that rank alone, while the other waited in
its next collective and then aborted. The outcome of compile's probe, traces and passes, and of a
re-trace, is now agreed over the cp group: every rank raises the same error, naming the rank.

The scenarios run one after another on 2 gloo ranks; each fails on both ranks at the same point,
so the ranks stay in step. The scenario that hung before runs last.
"""
from __future__ import annotations

import random

import pytest
import torch

from cp_harness import (
    HEAD_TAIL_WRAPPER, assert_fails_with, outcome_of, random_batch, sdpa_plan, tiny_qwen3,
)
from dist_utils import run_distributed

WORLD = 2
_results: dict = {}


def _setup(wrapper="sdpa_hf"):
    import cpcompile

    plan = cpcompile.load_plan(sdpa_plan(WORLD, wrapper=wrapper))
    return plan, cpcompile.build_mesh(plan.accelerator, device_type="cpu")


def _train_step(seed: int, wrapper, batch: dict, feed=None) -> None:
    """Compile with `wrapper` on this rank, shard `batch` for it, run one step (`feed` replaces the local batch)."""
    import cpcompile

    plan, mesh = _setup(wrapper)
    local = cpcompile.shard_batch(batch, mesh, plan)
    model = cpcompile.compile(tiny_qwen3(seed), mesh, plan, example_inputs=local)
    model(**(feed(local, mesh) if feed else local)).loss.backward()


def _retrace_with(seed: int, batch: dict, later: dict) -> None:
    import cpcompile

    plan, mesh = _setup()
    model = cpcompile.compile(tiny_qwen3(seed), mesh, plan, example_inputs=cpcompile.shard_batch(batch, mesh, plan))
    model(**cpcompile.shard_batch(later, mesh, plan)).loss.backward()


def _head_tail_batch(batch: dict, mesh) -> dict:
    import cpcompile

    head_tail, _ = _setup(HEAD_TAIL_WRAPPER)
    return cpcompile.shard_batch(batch, mesh, head_tail)


def _packed_without_ones_mask(seed: int, length: int, mesh, plan) -> dict:
    """A packed batch of two documents (the first 6 tokens long: its end lies on rank 0) sharded
    as shard_batch does, then stripped of its all-ones attention mask: transformers then builds a
    document mask on rank 0 only, which the rewrite refuses; rank 1's slice holds no document start."""
    import cpcompile

    batch = random_batch(seed, 1, length, padded=False)
    batch["position_ids"] = torch.cat([torch.arange(6), torch.arange(length - 6)])[None]
    local = cpcompile.shard_batch(batch, mesh, plan)
    local.pop("attention_mask")
    return local


def _mask_refused_on_rank_zero(seed: int, at_retrace: bool) -> None:
    import cpcompile

    plan, mesh = _setup()
    packed = _packed_without_ones_mask(seed, 16, mesh, plan)
    example = cpcompile.shard_batch(random_batch(seed, 1, 8, padded=False), mesh, plan) if at_retrace else packed
    model = cpcompile.compile(tiny_qwen3(seed), mesh, plan, example_inputs=example)
    model(**packed).loss.backward()


def _run(rank: int, world: int, seed: int) -> dict:
    batch = random_batch(seed, 1, 16, padded=False)
    own_length = random_batch(seed, 1, (16, 12)[rank], padded=False)
    unmarked = lambda local: dict(local, position_ids=local["position_ids"].clone())  # clone drops the marker
    return {
        "mask_on_one_rank_at_compile": outcome_of(lambda: _mask_refused_on_rank_zero(seed, at_retrace=False)),
        "mask_on_one_rank_at_retrace": outcome_of(lambda: _mask_refused_on_rank_zero(seed, at_retrace=True)),
        "lengths_at_compile": outcome_of(lambda: _train_step(seed, "sdpa_hf", own_length)),
        "lengths_at_retrace": outcome_of(
            lambda: _retrace_with(seed, batch, random_batch(seed, 1, (20, 12)[rank], padded=False))),
        "global_batch": outcome_of(lambda: _train_step(seed, "sdpa_hf", batch, feed=lambda local, mesh: batch)),
        "head_tail_batch": outcome_of(
            lambda: _train_step(seed, "sdpa_hf", batch, feed=lambda local, mesh: _head_tail_batch(batch, mesh))),
        "head_tail_batch_unmarked": outcome_of(
            lambda: _train_step(seed, "sdpa_hf", batch, feed=lambda local, mesh: unmarked(_head_tail_batch(batch, mesh)))),
        "all_gather_vs_head_tail": outcome_of(
            lambda: _train_step(seed, ("sdpa_hf", HEAD_TAIL_WRAPPER)[rank], batch)),
        "all_gather_vs_ulysses": outcome_of(lambda: _train_step(seed, ("sdpa_hf", "sdpa_hf_ulysses")[rank], batch)),
    }


def results() -> list:
    if not _results:
        _results["all"] = run_distributed(_run, WORLD, random.randrange(1 << 30), timeout=180)
    return _results["all"]


@pytest.mark.parametrize("scenario, error, words", [
    ("all_gather_vs_ulysses", "CPConfigError",
     ["ranks of the cp group disagree", "methods", "rank 0", "sdpa:all_gather", "rank 1", "sdpa:ulysses"]),
    ("all_gather_vs_head_tail", "CPConfigError",
     ["ranks of the cp group disagree", "layout", "rank 0: contiguous", "rank 1: head_tail"]),
    ("lengths_at_compile", "CPInputError",
     ["ranks of the cp group disagree", "model.layers.0.self_attn", "rank 0", "float32[1, 8, 32]", "rank 1",
      "float32[1, 6, 32]"]),
    ("lengths_at_retrace", "CPInputError",
     ["ranks of the cp group disagree", "model.layers.0.self_attn", "float32[1, 10, 32]", "float32[1, 6, 32]"]),
    ("global_batch", "CPInputError", ["position_ids", "shard_batch"]),
    ("mask_on_one_rank_at_compile", "UnsupportedMaskError",
     ["model.layers.0.self_attn", "attention mask", "cp rank 0 of 2 found this", "every rank"]),
    ("mask_on_one_rank_at_retrace", "UnsupportedMaskError",
     ["model.layers.0.self_attn", "attention mask", "cp rank 0 of 2 found this", "every rank"]),
    ("head_tail_batch", "CPInputError", ["sharded for the 'head_tail' layout", "'contiguous'"]),
    ("head_tail_batch_unmarked", "CPInputError", ["position_ids", "'contiguous' layout", "shard_batch"]),
])
def test_disagreement_is_refused_on_every_rank(scenario, error, words):
    for rank, result in enumerate(results()):
        assert_fails_with(f"{scenario} (rank {rank})", result[scenario], error, words)


def _global_positions_on_rank_one(rank: int, world: int) -> tuple | None:
    """Rank 1 of a fake group of 2 fed the whole batch with its global position ids (rank 0 cannot
    tell such a batch from its own slice: its positions start at 0 either way)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    plan, mesh = _setup()
    batch = random_batch(0, 1, 16, padded=False)
    model = cpcompile.compile(tiny_qwen3(0), mesh, plan, example_inputs=cpcompile.shard_batch(batch, mesh, plan))
    outcome = outcome_of(lambda: model(**batch, position_ids=torch.arange(16)[None], use_cache=False))
    dist.destroy_process_group()
    return outcome


def test_global_batch_with_global_positions_is_refused_on_later_ranks():
    (outcome,) = run_distributed(_global_positions_on_rank_one, 1, init_pg=False, timeout=120)
    assert_fails_with("global positions", outcome, "CPInputError",
                      ["position_ids", "'contiguous' layout", "cp rank 1", "start at 16", "shard_batch"])
