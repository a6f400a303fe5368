"""The architecture table (issue 30, item 7): tiny random models of many transformers causal LMs at
CP=2, one method each, exact against one process (logits, loss, every gradient).

The table in docs/methods.md lists these; keep the two in step. One launch of 2 gloo ranks.
"""
from __future__ import annotations

import random

import pytest
import torch

from cp_harness import (
    HEAD_TAIL_WRAPPER, assert_equivalent, assert_fails_with, compare_cp_run, outcome_of, random_batch, sdpa_plan,
)
from dist_utils import run_distributed
from gdn_harness import gdn_plan, tiny_qwen3_5, use_reference_gdn
from model_zoo import build

WORLD = 2
LENGTH = 16
ASYNC_ULYSSES = {"_target_": "cpcompile.wrappers.sdpa_hf_async_ulysses_cp_wrapper"}

# architecture -> (attention modules the plan matches, inner wrapper, padded batch)
ARCHITECTURES = {
    "llama": ("*.self_attn", "sdpa_hf", True),
    "mistral": ("*.self_attn", "sdpa_hf_ulysses", True),
    "qwen2": ("*.self_attn", HEAD_TAIL_WRAPPER, True),
    "qwen3": ("*.self_attn", ASYNC_ULYSSES, False),
    "gemma3": ("*.self_attn", "sdpa_hf", True),
    "phi3": ("*.self_attn", "sdpa_hf_ulysses", False),
    "gpt_neox": ("*.attention", HEAD_TAIL_WRAPPER, True),
    "falcon": ("*.self_attention", "sdpa_hf", True),
    "qwen3_moe": ("*.self_attn", "sdpa_hf_ulysses", True),
}
_results: dict = {}


def _run(rank: int, world: int, seed: int) -> dict:
    out = {}
    for i, (name, (match, wrapper, padded)) in enumerate(ARCHITECTURES.items()):
        plan = sdpa_plan(world, wrapper=wrapper, match=match)
        out[name] = compare_cp_run(lambda: build(name, seed), random_batch(seed + i, 2, LENGTH, padded), plan)
    # float64: fp32 gradients of the GDN decay parameters are ill-conditioned (gdn_harness)
    out["qwen3_5"] = compare_cp_run(lambda: use_reference_gdn(tiny_qwen3_5(seed, torch.float64)),
                                    random_batch(seed, 2, LENGTH, True), gdn_plan(world, "p2p", sdpa="sdpa_hf"))
    out["moe_aux_loss_config"] = outcome_of(lambda: compare_cp_run(
        lambda: build("qwen3_moe", seed, output_router_logits=True), random_batch(seed, 2, LENGTH, True),
        sdpa_plan(world, wrapper="sdpa_hf")))
    out["moe_aux_loss_call"] = outcome_of(lambda: compare_cp_run(
        lambda: build("qwen3_moe", seed), dict(random_batch(seed, 2, LENGTH, True), output_router_logits=True),
        sdpa_plan(world, wrapper="sdpa_hf")))
    return out


def results() -> list:
    if not _results:
        _results["all"] = run_distributed(_run, WORLD, random.randrange(1 << 30), timeout=300)
    return _results["all"]


@pytest.mark.parametrize("name", [*ARCHITECTURES, "qwen3_5"])
def test_architecture_is_exact(name):
    for result in results():
        assert_equivalent(result[name])


@pytest.mark.parametrize("scenario, error", [("moe_aux_loss_config", "UnsupportedError"),
                                             ("moe_aux_loss_call", "CPInputError")])
def test_a_moe_auxiliary_loss_is_refused_on_every_rank(scenario, error):
    """A MoE's load-balancing loss is a product of means over the step's tokens: per rank it is no
    share of the single process's. Before: Qwen3-MoE with output_router_logits ran, its loss and
    router gradients off one process, no error."""
    for rank, result in enumerate(results()):
        assert_fails_with(f"rank {rank}", result[scenario], error, ["output_router_logits=True", "load-balancing"])
