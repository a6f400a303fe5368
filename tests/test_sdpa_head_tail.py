"""Head-Tail load-balanced AllGather CP for SDPA: CP=2 and CP=4 gloo runs equal the CP=1 run
(issue 3). `shard_batch` puts chunks r and 2·cp−1−r on rank r and `unshard` restores global
order, so logits, loss and gradients compare directly with the single-device run."""
from __future__ import annotations

import random

import pytest

from cp_harness import compare_cp_run, random_batch, sdpa_plan, tiny_qwen3, HEAD_TAIL_WRAPPER, assert_equivalent, method_scenarios
from dist_utils import run_distributed

SCENARIOS = ("qwen3", "qwen3_padded", "llama_mqa_padded")
_results: dict[int, list] = {}


def _run_all(rank: int, world: int, seed: int) -> dict:
    return method_scenarios(seed, world, HEAD_TAIL_WRAPPER)


def results_for(world: int) -> list:
    if world not in _results:
        _results[world] = run_distributed(_run_all, world, random.randrange(1 << 30), timeout=600)
    return _results[world]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_head_tail_matches_single_device(world, scenario):
    for result in results_for(world):
        assert_equivalent(result[scenario])


def _aot_eager(rank: int, world: int, seed: int) -> dict:
    plan = sdpa_plan(world, wrapper=HEAD_TAIL_WRAPPER)
    return compare_cp_run(lambda: tiny_qwen3(seed), random_batch(seed, 2, 4 * world, padded=True), plan,
                          compile_backend="aot_eager")


@pytest.mark.slow
def test_under_aot_eager():
    for result in run_distributed(_aot_eager, 2, random.randrange(1 << 30), timeout=600):
        assert_equivalent(result)


def _mask_then_none(rank: int, world: int, seed: int) -> list[float]:
    """One cached graph serves batches with and without a padding mask (HF builds different
    local masks for the two, of the same shape): logits stay right for both orders."""
    import cpcompile
    from cp_harness import rel

    plan = cpcompile.load_plan(sdpa_plan(world, wrapper=HEAD_TAIL_WRAPPER))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    reference = tiny_qwen3(seed)
    padded = random_batch(seed, 2, 4 * world, padded=True)
    plain = {k: v for k, v in random_batch(seed + 1, 2, 4 * world, padded=False).items()}
    plain["attention_mask"] = None
    batches = [plain, padded, plain]
    model = cpcompile.compile(tiny_qwen3(seed), mesh, plan, example_inputs=cpcompile.shard_batch(
        {k: v for k, v in plain.items() if v is not None}, mesh, plan))
    errors = []
    for batch in batches:
        batch = {k: v for k, v in batch.items() if v is not None}
        want = reference(**batch, use_cache=False).logits
        got = cpcompile.unshard(model(**cpcompile.shard_batch(batch, mesh, plan)).logits, mesh, plan)
        errors.append(rel(got.detach(), want.detach()))
    return errors


def test_one_graph_serves_batches_with_and_without_mask():
    for errors in run_distributed(_mask_then_none, 2, random.randrange(1 << 30), timeout=300):
        assert max(errors) <= 1e-5, errors
