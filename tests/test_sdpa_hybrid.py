"""Hybrid CP for SDPA (Ulysses sub-groups of 2, ring sub-groups of 2): CP=4 gloo runs equal
the CP=1 run (issue 3). tiny Llama's single KV head is replicated inside the Ulysses sub-group."""
from __future__ import annotations

import random

import pytest

from cp_harness import compare_cp_run, random_batch, sdpa_plan, tiny_qwen3, assert_equivalent, hybrid_wrapper, method_scenarios
from dist_utils import run_distributed

WORLD, ULYSSES_DEGREE = 4, 2
SCENARIOS = ("qwen3", "qwen3_padded", "llama_mqa_padded")
_results: list = []


def _run_all(rank: int, world: int, seed: int) -> dict:
    return method_scenarios(seed, world, hybrid_wrapper(ULYSSES_DEGREE))


def results() -> list:
    if not _results:
        _results.extend(run_distributed(_run_all, WORLD, random.randrange(1 << 30), timeout=600))
    return _results


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_hybrid_matches_single_device(scenario):
    for result in results():
        assert_equivalent(result[scenario])


def _aot_eager(rank: int, world: int, seed: int) -> dict:
    plan = sdpa_plan(world, wrapper=hybrid_wrapper(ULYSSES_DEGREE))
    return compare_cp_run(lambda: tiny_qwen3(seed), random_batch(seed, 2, 4 * world, padded=True), plan,
                          compile_backend="aot_eager")


@pytest.mark.slow
def test_under_aot_eager():
    for result in run_distributed(_aot_eager, WORLD, random.randrange(1 << 30), timeout=600):
        assert_equivalent(result)
