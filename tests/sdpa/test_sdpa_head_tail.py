"""Head-Tail specifics (its equivalence runs are in test_sdpa_methods_equivalence.py)."""
from __future__ import annotations

import random

from cp_harness import HEAD_TAIL_WRAPPER, random_batch, sdpa_plan, tiny_qwen3
from dist_utils import run_distributed


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
