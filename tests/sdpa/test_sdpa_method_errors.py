"""Fail-fast rules of the Ulysses, Hybrid and Head-Tail rewrites (issue 3): each raises at
compile time, before anything runs, with a message naming its cause.

The compile-time checks run in one child process, rank 0 of a fake process group of 4: CP=4
plans use the whole world, CP=2 plans pair cp with dp_shard=2. The plan-combination rule is a
pure function and is checked here directly.
"""
from __future__ import annotations

import pytest
import torch

from cp_harness import outcome_of, HEAD_TAIL_WRAPPER, assert_fails_with, hybrid_wrapper, qwen3_with_heads, sdpa_plan
from dist_utils import run_distributed

ULYSSES_DEGREE_GIVEN = {"_target_": "cpcompile.wrappers.sdpa_hf_ulysses_cp_wrapper", "ulysses_degree": 2}
_outcomes: dict = {}



def _plan(cp: int, wrapper) -> dict:
    plan = sdpa_plan(cp, wrapper=wrapper)
    plan["accelerator"] = {"cp_size": cp, "dp_shard_size": 4 // cp}
    return plan


def _all_checks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)

    def compile_with(cp, wrapper, q_heads=4, kv_heads=2, length=8):
        plan = cpcompile.load_plan(_plan(cp, wrapper))
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
        local = {"input_ids": torch.randint(0, 96, (1, length)), "position_ids": torch.arange(length)[None],
                 "use_cache": False}
        cpcompile.compile(qwen3_with_heads(0, q_heads, kv_heads), mesh, plan, example_inputs=local)

    checks = {
        "ulysses_query_heads": lambda: compile_with(4, "sdpa_hf_ulysses", q_heads=6, kv_heads=2),
        "ulysses_kv_heads": lambda: compile_with(4, "sdpa_hf_ulysses", q_heads=12, kv_heads=3),
        "ulysses_degree_given": lambda: compile_with(4, ULYSSES_DEGREE_GIVEN),
        "hybrid_heads": lambda: compile_with(4, hybrid_wrapper(2), q_heads=3, kv_heads=1),
        "hybrid_degree_one": lambda: compile_with(4, hybrid_wrapper(1)),
        "hybrid_degree_is_cp": lambda: compile_with(4, hybrid_wrapper(4)),
        "hybrid_cp_not_divisible": lambda: compile_with(4, hybrid_wrapper(3)),
        "head_tail_odd_local_length": lambda: compile_with(2, HEAD_TAIL_WRAPPER, length=5),
    }
    results = {name: outcome_of(fn) for name, fn in checks.items()}
    dist.destroy_process_group()
    return results


def outcome(name):
    if not _outcomes:
        (_outcomes["all"],) = run_distributed(_all_checks, 1, init_pg=False, timeout=300)
    return _outcomes["all"][name]


@pytest.mark.parametrize("name, error, words", [
    ("ulysses_query_heads", "CPInputError", ["model.layers.0.self_attn", "6 query heads", "cp_size=4"]),
    ("ulysses_kv_heads", "CPInputError", ["model.layers.0.self_attn", "3 KV heads", "cp_size=4"]),
    ("ulysses_degree_given", "PlanError", ["plan_overrides[0].inner_wrapper", "ulysses_degree"]),
    ("hybrid_heads", "CPInputError", ["model.layers.0.self_attn", "3 query heads", "ulysses_degree=2", "cp_size=4"]),
    ("hybrid_degree_one", "PlanError", ["plan_overrides[0].inner_wrapper", "ulysses_degree must be an integer >= 2"]),
    ("hybrid_degree_is_cp", "CPConfigError", ["1 < ulysses_degree < cp_size", "ulysses_degree=4, cp_size=4"]),
    ("hybrid_cp_not_divisible", "CPConfigError", ["cp_size=4 is not divisible by ulysses_degree=3"]),
    ("head_tail_odd_local_length", "CPInputError", ["model.layers.0.self_attn", "even local sequence length", "got 5"]),
])
def test_fail_fast_rule(name, error, words):
    assert_fails_with(name, outcome(name), error, words)


def _overrides(*methods):
    """Active overrides of a cp=2 plan, one per (match, method)."""
    from cpcompile.plan import AcceleratorConfig, Override, Plan

    plan = Plan(AcceleratorConfig(cp_size=2), tuple(
        Override(match=match, when="cp", region_dispatch=False, method=method) for match, method in methods
    ))
    return plan.validate().active_overrides()


@pytest.mark.parametrize("contiguous", ["sdpa_hf_cp_wrapper", "sdpa_hf_ulysses_cp_wrapper", "sdpa_hf_hybrid_cp_wrapper"])
def test_head_tail_with_contiguous_method_is_refused(contiguous):
    from cpcompile import wrappers
    from cpcompile.plan import sequence_layout

    params = {"ulysses_degree": 2} if "hybrid" in contiguous else {}
    overrides = _overrides(("*.layers.0.self_attn", wrappers.sdpa_hf_load_balance_cp_wrapper()),
                           ("*.layers.1.self_attn", getattr(wrappers, contiguous)(**params)))
    with pytest.raises(ValueError) as err:
        sequence_layout(overrides)
    for word in ("plan_overrides[1].inner_wrapper", "*.layers.1.self_attn", "plan_overrides[0].inner_wrapper",
                 "*.layers.0.self_attn", "contiguous sequence order", "head-tail"):
        assert word in str(err.value), f"{word!r} not in {err.value}"


def test_head_tail_with_contiguous_gdn_is_refused():
    """A contiguous GDN method beside SDPA Head-Tail: one batch has one order (the message of any
    contiguous method beside Head-Tail)."""
    from cpcompile.adapters.qwen3_5 import qwen3_5_gdn_p2p_cp_wrapper
    from cpcompile.plan import sequence_layout
    from cpcompile.wrappers import sdpa_hf_load_balance_cp_wrapper

    overrides = _overrides(("*.linear_attn", qwen3_5_gdn_p2p_cp_wrapper()),
                           ("*.self_attn", sdpa_hf_load_balance_cp_wrapper()))
    with pytest.raises(ValueError) as err:
        sequence_layout(overrides)
    for word in ("plan_overrides[0].inner_wrapper", "*.linear_attn", "plan_overrides[1].inner_wrapper",
                 "*.self_attn", "contiguous sequence order", "head-tail", "one batch has one order"):
        assert word in str(err.value), f"{word!r} not in {err.value}"


def test_head_tail_gdn_with_contiguous_sdpa_is_refused():
    from cpcompile.adapters.qwen3_5 import qwen3_5_gdn_p2p_head_tail_cp_wrapper
    from cpcompile.plan import sequence_layout
    from cpcompile.wrappers import sdpa_hf_cp_wrapper

    overrides = _overrides(("*.linear_attn", qwen3_5_gdn_p2p_head_tail_cp_wrapper()),
                           ("*.self_attn", sdpa_hf_cp_wrapper()))
    with pytest.raises(ValueError) as err:
        sequence_layout(overrides)
    for word in ("plan_overrides[1].inner_wrapper", "*.self_attn", "plan_overrides[0].inner_wrapper",
                 "*.linear_attn", "contiguous sequence order", "one batch has one order"):
        assert word in str(err.value), f"{word!r} not in {err.value}"


def test_head_tail_gdn_beside_head_tail_sdpa_is_one_plan():
    """GDN in Head-Tail order (either method) and SDPA Head-Tail: one layout, and a packed batch
    keeps the two fixed chunks (`Plan.cuts_documents`)."""
    from cpcompile.adapters.qwen3_5 import (
        qwen3_5_gdn_all_gather_head_tail_cp_wrapper, qwen3_5_gdn_p2p_head_tail_cp_wrapper,
    )
    from cpcompile.plan import AcceleratorConfig, Override, Plan
    from cpcompile.wrappers import sdpa_hf_load_balance_cp_wrapper

    def plan(*methods):
        return Plan(AcceleratorConfig(cp_size=2), tuple(
            Override(match=f"m{i}", when="cp", region_dispatch=False, method=m) for i, m in enumerate(methods)))

    for gdn in (qwen3_5_gdn_p2p_head_tail_cp_wrapper(), qwen3_5_gdn_all_gather_head_tail_cp_wrapper()):
        both = plan(gdn, sdpa_hf_load_balance_cp_wrapper()).validate()
        assert both.layout() == "head_tail" and not both.cuts_documents()
    assert plan(sdpa_hf_load_balance_cp_wrapper()).validate().cuts_documents()


def test_head_tail_alone_or_other_methods_alone_are_accepted():
    from cpcompile.plan import sequence_layout
    from cpcompile.wrappers import sdpa_hf_cp_wrapper, sdpa_hf_load_balance_cp_wrapper, sdpa_hf_ulysses_cp_wrapper

    both_head_tail = _overrides(("a", sdpa_hf_load_balance_cp_wrapper()), ("b", sdpa_hf_load_balance_cp_wrapper()))
    assert sequence_layout(both_head_tail) == "head_tail"
    assert sequence_layout(_overrides(("a", sdpa_hf_cp_wrapper()), ("b", sdpa_hf_ulysses_cp_wrapper()))) == "contiguous"
