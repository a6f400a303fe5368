"""The cut audit (audit/cuts.py) judges code, not precision: called under the caller's autocast (a
Hugging Face Trainer's first step runs under accelerate's), its runs of the model on the window and
its halves are out of it, at the model's own precision, where its float32 tolerance applies; the
probe forward before them keeps the autocast, whose precision the regions trace."""
from __future__ import annotations

from dist_utils import run_distributed


def _autocast_seen_outside_the_regions(rank: int, world: int) -> list[bool]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile
    from cp_harness import sdpa_plan, tiny_qwen3

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    plan = cpcompile.load_plan(sdpa_plan(2))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    model = tiny_qwen3(seed=0)
    seen = []
    model.model.norm.register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    ids = torch.randint(0, 96, (1, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpcompile.compile(model, mesh, plan, example_inputs=cpcompile.shard_batch({"input_ids": ids}, mesh, plan))
    dist.destroy_process_group()
    return seen


def test_the_cut_runs_leave_the_callers_autocast():
    (seen,) = run_distributed(_autocast_seen_outside_the_regions, 1, init_pg=False, timeout=120)
    assert seen[0] is True, seen  # the probe forward, at the step's precision
    assert seen.count(False) >= 3 and True not in seen[seen.index(False):], seen  # the window and its two halves
