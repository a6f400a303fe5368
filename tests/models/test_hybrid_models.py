"""Hybrid models and multi-head latent attention at CP=2 (issue 30, item 5): exact, or refused on
every rank naming the module.

Before: with a plan rewriting only `*.self_attn`, the other sequence mixers of hybrid models ran
on each rank's slice alone — Qwen3-Next's GatedDeltaNet, Jamba's and Bamba's Mamba, Falcon-H1's
Mamba2 beside attention, LFM2's short convolutions — with gradients 0.3-0.7 relative off one
process and no error; Qwen3-Next's GatedDeltaNet under a GDN method was refused ("ran no gdn
core"); DeepSeek-V3's attention (value head 16, query/key head 24) crashed in the local kernel.

Now every module outside the regions is audited at `compile` for mixing positions (one token of
its input changed, its output watched elsewhere): the mixers above are refused with a
`CoverageError` naming the module and its class, on every rank; an unknown mixer (a cumulative
sum) is too. Qwen3-Next's GatedDeltaNet takes the GDN methods; MLA is exact (the smaller head
size padded with zeros in the local kernels).

All scenarios run in one launch of 2 gloo ranks.
"""
from __future__ import annotations

import random

import pytest
import torch

from cp_harness import (
    RunningSum, assert_equivalent, assert_fails_with, compare_cp_run, outcome_of, random_batch, sdpa_plan,
)
from dist_utils import run_distributed
from gdn_harness import gdn_plan, use_reference_gdn
from model_zoo import build

WORLD = 2
LENGTH = 16
_results: dict = {}

REFUSED = {  # model -> the module and class the refusal must name
    "jamba": ("model.layers.0.mamba", "JambaMambaMixer"),
    "bamba": ("model.layers.0.mamba", "BambaMixer"),
    "falcon_h1": ("model.layers.0.mamba", "FalconH1Mixer"),
    "lfm2": ("model.layers.0.conv", "Lfm2ShortConv"),
    "qwen3_next": ("model.layers.0.linear_attn", "Qwen3NextGatedDeltaNet"),
}


def with_running_sum(seed: int):
    model = build("qwen3", seed)
    model.model.layers[1].mlp = RunningSum(model.model.layers[1].mlp)
    return model


def _compile_and_step(make_model, plan, seed: int):
    from cp_harness import cp_outputs

    return cp_outputs(make_model, random_batch(seed, 2, LENGTH, padded=False), plan)


def _run(rank: int, world: int, seed: int) -> dict:
    sdpa_only = sdpa_plan(world)
    results = {name: outcome_of(lambda name=name: _compile_and_step(lambda: build(name, seed), sdpa_only, seed))
               for name in REFUSED}
    results["running_sum"] = outcome_of(lambda: _compile_and_step(lambda: with_running_sum(seed), sdpa_only, seed))
    # float64 (dense MLPs: the MoE kernel takes no float64): fp32 decay gradients are ill-conditioned (gdn_harness)
    qwen3_next = lambda: use_reference_gdn(build("qwen3_next", seed, torch.float64, mlp_only_layers=[0, 1]))
    results["qwen3_next_gdn_p2p"] = compare_cp_run(qwen3_next, random_batch(seed + 1, 2, LENGTH, padded=True),
                                                   gdn_plan(world, "p2p", sdpa="sdpa_hf"))
    results["qwen3_next_gdn_ulysses"] = compare_cp_run(qwen3_next, random_batch(seed + 2, 1, LENGTH, padded=False),
                                                       gdn_plan(world, "ulysses", sdpa="sdpa_hf_ulysses"))
    deepseek = lambda: build("deepseek_v3", seed)
    results["deepseek_v3_all_gather"] = compare_cp_run(deepseek, random_batch(seed + 3, 2, LENGTH, padded=True), sdpa_only)
    results["deepseek_v3_ulysses"] = compare_cp_run(deepseek, random_batch(seed + 4, 1, LENGTH, padded=False),
                                                    sdpa_plan(world, wrapper="sdpa_hf_ulysses"))
    return results


def results() -> list:
    if not _results:
        _results["all"] = run_distributed(_run, WORLD, random.randrange(1 << 30), timeout=300)
    return _results["all"]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_sequence_mixers_outside_the_plan_are_refused_on_every_rank(name):
    module, kind = REFUSED[name]
    for rank, result in enumerate(results()):
        assert_fails_with(f"{name} (rank {rank})", result[name], "CoverageError", [module, kind])


def test_an_unknown_mixer_is_refused_by_its_behaviour():
    for rank, result in enumerate(results()):
        assert_fails_with(f"running sum (rank {rank})", result["running_sum"], "CoverageError",
                          ["model.layers.1.mlp (RunningSum)", "mix positions", "later"])


@pytest.mark.parametrize("scenario", ["qwen3_next_gdn_p2p", "qwen3_next_gdn_ulysses", "deepseek_v3_all_gather",
                                      "deepseek_v3_ulysses"])
def test_qwen3_next_gdn_and_latent_attention_are_exact(scenario):
    for result in results():
        assert_equivalent(result[scenario])
