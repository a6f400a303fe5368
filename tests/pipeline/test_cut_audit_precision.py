"""The cut audit (audit/cuts.py) judges code, not precision: called under the caller's autocast (a
Hugging Face Trainer's first step runs under accelerate's), its runs of the model on the window and
its halves are out of it, at the model's own precision, where its float32 tolerance applies; the
probe forward before them keeps the autocast, whose precision the regions trace. Also when the
autocast is entered by the model's own forward, as accelerate's mixed precision wraps it (a Trainer
with `bf16=True`): the cut runs call the original forward it keeps."""
from __future__ import annotations

import functools
from types import MethodType

import pytest
from dist_utils import run_distributed


def _wrap_forward_as_accelerate_does(model) -> None:
    import torch

    model._original_forward = model.forward
    inner = model.forward.__func__

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return inner(self, *args, **kwargs)
    model.forward = MethodType(forward, model)


def _autocast_seen_outside_the_regions(rank: int, world: int, inside: bool) -> list[bool]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile
    from cp_harness import sdpa_plan, tiny_qwen3

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    plan = cpcompile.load_plan(sdpa_plan(2))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    model = tiny_qwen3(seed=0)
    if inside:
        _wrap_forward_as_accelerate_does(model)
    seen = []
    model.model.norm.register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    ids = torch.randint(0, 96, (1, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not inside):
        cpcompile.compile(model, mesh, plan, example_inputs=cpcompile.shard_batch({"input_ids": ids}, mesh, plan))
    dist.destroy_process_group()
    return seen


@pytest.mark.parametrize("inside", [False, True], ids=["caller", "model_forward"])
def test_the_cut_runs_leave_the_callers_autocast(inside):
    (seen,) = run_distributed(_autocast_seen_outside_the_regions, 1, inside, init_pg=False, timeout=120)
    assert seen[0] is True, seen  # the probe forward, at the step's precision
    assert seen.count(False) >= 3 and True not in seen[seen.index(False):], seen  # the window and its two halves
