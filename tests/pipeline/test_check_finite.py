"""`CPCOMPILE_CHECK_FINITE=1` (finite.py): a region that computes NaN or Inf raises
`NonFiniteError` naming the region, forward or backward, and the step; off by default.

The guard alone (forward output, input already non-finite, backward gradient, the step), then on a
compiled tiny Qwen3.5 (GDN State-P2P + SDPA AllGather, 2 gloo ranks): a finite step passes with the
guard on, a NaN weight in one GDN layer on one rank makes every rank raise the same error naming
that layer and rank, and with the guard off the same NaN passes silently into the loss.
"""
from __future__ import annotations

import pytest
import torch

from cp_harness import random_batch
from dist_utils import run_distributed
from gdn_harness import gdn_plan, tiny_qwen3_5

from cpcompile.errors import NonFiniteError
from cpcompile.finite import FiniteGuard, set_step


class _NaNGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def test_guard_names_region_step_and_cause():
    guard = FiniteGuard("model.layers.0.linear_attn")
    finite = torch.ones(3)
    assert torch.equal(guard.around([finite], lambda leaves: leaves[0] * 2), finite * 2)
    with pytest.raises(NonFiniteError, match=r"layers\.0\.linear_attn: .*forward output has NaN or Inf on cp "
                                             r"rank\(s\) \[0\] at forward call 2 of this region \(its inputs were finite"):
        guard.around([finite], lambda leaves: leaves[0] / 0)
    set_step(7)
    try:
        with pytest.raises(NonFiniteError, match="at step 7 .*its input was already non-finite"):
            guard.around([torch.tensor([float("inf")])], lambda leaves: leaves[0] * 2)
        x = torch.ones(3, requires_grad=True)
        out = guard.around([x], lambda leaves: _NaNGradient.apply(leaves[0]))
        with pytest.raises(NonFiniteError, match=r"backward gave its input a NaN or Inf gradient on cp rank\(s\) \[0\] at step 7"):
            out.sum().backward()
    finally:
        set_step(None)


def _step_with_nan_weight(rank: int, world: int, guard: bool):
    import os

    import cpcompile

    os.environ["CPCOMPILE_CHECK_FINITE"] = "1" if guard else "0"
    plan = cpcompile.load_plan(gdn_plan(world, "p2p", sdpa="sdpa_hf"))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(random_batch(3, 1, 16, padded=False), mesh, plan)
    model = cpcompile.compile(tiny_qwen3_5(0), mesh, plan, example_inputs=local)
    model(**local).loss.backward()  # finite: passes with the guard on
    if rank == 1:
        with torch.no_grad():
            model.model.layers[1].linear_attn.out_proj.weight[0, 0] = float("nan")
    try:
        loss = model(**local).loss
    except NonFiniteError as exc:
        return str(exc)
    return f"loss {loss.item()}"


def test_guard_on_a_compiled_model():
    with_guard = run_distributed(_step_with_nan_weight, 2, True)
    assert with_guard[0] == with_guard[1], with_guard  # every rank raises, none is left waiting
    assert with_guard[1].startswith("model.layers.1.linear_attn: the CP region's forward output has NaN or Inf on "
                                    "cp rank(s) [1] at forward call 2 of this region (its inputs were finite"), with_guard
    without = run_distributed(_step_with_nan_weight, 2, False)
    assert without[1] == "loss nan", without  # off by default: the NaN reaches the loss unnamed


def test_trainer_steps_name_the_step():
    """`cpcompile train` sets the step the guard names as it enters each step's forward."""
    from cpcompile.trainer.progress import Progress

    Progress(60.0).at("forward", 3)
    try:
        with pytest.raises(NonFiniteError, match="at step 3 "):
            FiniteGuard("region").around([torch.ones(2)], lambda leaves: leaves[0] / 0)
    finally:
        set_step(None)
