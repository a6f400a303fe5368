"""`local_compute_fn` and the public CP primitives (issue 18, part 2).

The example's hand-written attention (softmax(QKᵀ)V, no SDPA) made CP-correct two ways —
AllGather and Ulysses, sync and async — equals the single-process model on 2 gloo ranks (output
and every gradient); each primitive is checked against what it must compute, forward and
backward; bad declarations fail before anything runs, one test each.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import sys

import pytest
import torch

import cpcompile
from cp_harness import QKVHolder, assert_fails_with, outcome_of
from cpcompile.primitives import (
    all_gather_sequence, gather_key_padding, global_mean_loss, global_positions, heads_to_sequence, query_offset,
    sequence_to_heads,
)
from dist_utils import run_distributed

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "custom_local_compute.py")
TOL = 1e-5
_cache: dict = {}


def example():
    if "custom_local_compute" not in sys.modules:
        spec = importlib.util.spec_from_file_location("custom_local_compute", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["custom_local_compute"] = module
        spec.loader.exec_module(module)
    return sys.modules["custom_local_compute"]


@cpcompile.local_compute_fn
def missing_value(module, q, k, *, cp):  # the region is called with q, k and v
    return q


@cpcompile.local_compute_fn(collectives=False)
def gathers_but_says_not(module, q, k, v, *, cp):
    return module.attend(q, all_gather_sequence(k, cp, 2), all_gather_sequence(v, cp, 2), 0)


@cpcompile.local_compute_fn
def sdpa_with_gathered_keys(module, q, k, v, *, cp):
    """Takes over an SDPA core: cpcompile must not rewrite the SDPA call inside it again."""
    keys, values = all_gather_sequence(k, cp, seq_dim=2), all_gather_sequence(v, cp, seq_dim=2)
    first = query_offset(q.shape[2], cp)
    visible = torch.arange(keys.shape[2])[None, :] <= torch.arange(first, first + q.shape[2])[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible)


def _sdpa_core(rank: int, world: int, seed: int) -> dict:
    """A local_compute_fn covering an SDPA core (QKVHolder's `core`) equals plain causal SDPA."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 4 * world, 8, generator=gen) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    plan = cpcompile.load_plan({"accelerator": {"cp_size": world}, "plan_overrides": [
        {"match": "core", "when": "cp", "region_dispatch": False, "local_compute_fn": sdpa_with_gathered_keys}]})
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = tuple(t.chunk(world, dim=2)[rank].contiguous() for t in (q, k, v))
    holder = cpcompile.compile(QKVHolder(), mesh, plan, example_inputs=local)
    got = holder(*local)
    sdpa_calls = [n for n in next(iter(holder.core.forward.__self__.programs.values())).gm.graph.nodes
                  if "scaled_dot_product" in str(n.target)]
    return {"error": (got - want.chunk(world, dim=2)[rank]).abs().max().item(), "sdpa_calls": len(sdpa_calls)}


def not_decorated(module, q, k, v, *, cp):
    return q


# ----------------------------------------------------------------------------- 2 gloo ranks


def _primitives(rank: int, world: int, seed: int) -> dict:
    mesh = cpcompile.build_mesh(cpcompile.AcceleratorConfig(cp_size=world), device_type="cpu")
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(2, 4, 6 * world, 3, generator=gen)             # [B, H, S, D], the same on every rank
    weights = torch.randn(world, *full.shape, generator=gen)          # rank r's loss weights
    chunk = full.chunk(world, dim=2)[rank].clone().requires_grad_()
    errors = {}

    gathered = all_gather_sequence(chunk, mesh, seq_dim=2)
    (gathered * weights[rank]).sum().backward()
    errors["all_gather"] = (gathered - full).abs().max().item()
    errors["all_gather_grad"] = (chunk.grad - weights.sum(0).chunk(world, dim=2)[rank]).abs().max().item()

    chunk.grad = None
    heads = sequence_to_heads(chunk, mesh)
    (heads * weights[rank].chunk(world, dim=1)[0]).sum().backward()  # the same [B, H/cp, S, D] weight shape
    errors["seq_to_heads"] = (heads - full.chunk(world, dim=1)[rank]).abs().max().item()
    # rank j's heads block of every position: chunk's gradient is rank j's weight at its tokens
    want = torch.cat([weights[j].chunk(world, dim=1)[0].chunk(world, dim=2)[rank] for j in range(world)], dim=1)
    errors["seq_to_heads_grad"] = (chunk.grad - want).abs().max().item()
    errors["round_trip"] = (heads_to_sequence(sequence_to_heads(chunk, mesh), mesh) - chunk).abs().max().item()

    mask = torch.rand(2, full.shape[2], generator=gen) > 0.3
    errors["key_padding"] = int((gather_key_padding(mask.chunk(world, dim=1)[rank], mesh) != mask).sum())
    local_len = full.shape[2] // world
    errors["positions"] = int((global_positions(local_len, mesh) != torch.arange(full.shape[2]).chunk(world)[rank]).sum())
    losses = torch.rand(full.shape[2], generator=gen)
    loss = global_mean_loss(losses.chunk(world)[rank].sum(), local_len, mesh)
    errors["global_mean_loss"] = abs(loss.item() - losses.mean().item())
    return errors


def _run(rank: int, world: int, seed: int, dump_root: str) -> dict:
    ex = example()
    results = {
        "all_gather": ex.compare(ex.cp_hand_attention, seed=seed),
        "ulysses": ex.compare(ex.cp_hand_attention_ulysses, seed=seed),
        "async": ex.compare({"_target_": "custom_local_compute.cp_hand_attention", "asynchronous": True}, seed=seed,
                            dump_dir=dump_root),
        "primitives": _primitives(rank, world, seed),
        "sdpa_core": _sdpa_core(rank, world, seed),
    }
    with open(os.path.join(dump_root, f"rank{rank}", "summary.json")) as f:  # compile: one folder per rank
        results["async_schedule"] = [c for r in json.load(f)["regions"] for c in r["schedule"]]
    x = (torch.randn(1, 8, 16),)

    def compile_with(fn, region_dispatch=False):
        plan = ex.plan(world, fn)
        plan["plan_overrides"][0]["region_dispatch"] = region_dispatch
        plan = cpcompile.load_plan(plan)
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
        cpcompile.compile(ex.TinyModel(), mesh, plan, example_inputs=(x[0].chunk(world, dim=1)[rank],))

    results["signature"] = outcome_of(lambda: compile_with(missing_value))
    results["undeclared_collectives"] = outcome_of(lambda: compile_with(gathers_but_says_not, region_dispatch=True))

    def twice():
        plan = cpcompile.load_plan(ex.plan(world, ex.cp_hand_attention))
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
        model, local = ex.TinyModel(), (x[0].chunk(world, dim=1)[rank],)
        cpcompile.compile(model, mesh, plan, example_inputs=local)
        cpcompile.compile(model, mesh, plan, example_inputs=local)

    results["twice"] = outcome_of(twice)
    return results


def results(tmp_path_factory) -> list[dict]:
    if "all" not in _cache:
        dump = str(tmp_path_factory.mktemp("local_compute_dump"))
        _cache["all"] = run_distributed(_run, 2, random.randrange(1 << 30), dump, timeout=300)
    return _cache["all"]


@pytest.mark.parametrize("variant", ["all_gather", "ulysses", "async"])
def test_hand_written_attention_matches_single_process(variant, tmp_path_factory):
    for rank_result in results(tmp_path_factory):
        got = rank_result[variant]
        assert got["installed"]
        assert got["output"] <= TOL, f"output rel err {got['output']:.3g}"
        worst = max(got["grads"], key=got["grads"].get)
        assert got["grads"][worst] <= TOL, f"gradient of {worst}: rel err {got['grads'][worst]:.3g}"


def test_local_compute_fn_takes_over_an_sdpa_core(tmp_path_factory):
    for rank_result in results(tmp_path_factory):
        assert rank_result["sdpa_core"]["error"] <= 1e-6, rank_result["sdpa_core"]
        assert rank_result["sdpa_core"]["sdpa_calls"] == 1  # the user's call, not rewritten into CP kernels


def test_async_local_compute_overlaps_a_gather(tmp_path_factory):
    schedule = results(tmp_path_factory)[0]["async_schedule"]
    assert schedule and all(c["collective"].startswith("all_gather") for c in schedule)
    assert any(c["model_compute_between"] for c in schedule), schedule


@pytest.mark.parametrize("primitive", ["all_gather", "all_gather_grad", "seq_to_heads", "seq_to_heads_grad",
                                       "round_trip", "key_padding", "positions", "global_mean_loss"])
def test_primitive(primitive, tmp_path_factory):
    for rank_result in results(tmp_path_factory):
        assert rank_result["primitives"][primitive] <= 1e-6, rank_result["primitives"]


def test_signature_that_does_not_fit_the_region(tmp_path_factory):
    for rank_result in results(tmp_path_factory):
        assert_fails_with("signature", rank_result["signature"], "CPInputError",
                          ["blocks.0.core", "missing_value", "does not fit", "arg2"])


def test_collectives_in_a_function_declared_without(tmp_path_factory):
    for rank_result in results(tmp_path_factory):
        assert_fails_with("undeclared_collectives", rank_result["undeclared_collectives"], "CPInputError",
                          ["gathers_but_says_not", "without collectives", "all_gather_into_tensor"])


def test_region_compiled_twice(tmp_path_factory):
    for rank_result in results(tmp_path_factory):
        assert_fails_with("twice", rank_result["twice"], "AlreadyCompiledError", ["blocks.0.core", "already compiled"])


# ----------------------------------------------------------------------------- plan declarations


def _plan_error(fn, **override):
    entry = {"match": "blocks.*.core", "when": "cp", "region_dispatch": False, "local_compute_fn": fn, **override}
    with pytest.raises(cpcompile.PlanError) as info:
        cpcompile.load_plan({"accelerator": {"cp_size": 2}, "plan_overrides": [entry]})
    return str(info.value)


def test_both_inner_wrapper_and_local_compute_fn():
    message = _plan_error(example().cp_hand_attention, inner_wrapper="sdpa_hf")
    assert "plan_overrides[0].inner_wrapper" in message and "both are set" in message


@pytest.mark.parametrize("fn", [not_decorated, "mypkg.cp.attention"])
def test_unregistered_function(fn):
    message = _plan_error(fn)
    assert "plan_overrides[0].local_compute_fn" in message and "not a registered local compute function" in message


def test_collectives_with_region_dispatch_true():
    message = _plan_error(example().cp_hand_attention, region_dispatch=True)
    assert "plan_overrides[0].region_dispatch" in message and "has collectives" in message
    assert "requires region_dispatch: false" in message


def test_unknown_parameter():
    message = _plan_error({"_target_": "custom_local_compute.cp_hand_attention", "schedule": "async"})
    assert "unknown parameter 'schedule'" in message


@pytest.mark.parametrize("primitive, shape", [("sequence_to_heads", (1, 3, 4, 2)), ("heads_to_sequence", (1, 2, 5, 2))])
def test_ulysses_primitives_refuse_shapes_that_do_not_split(primitive, shape):
    """Heads (to heads) or tokens (to sequence) that do not divide by cp: a CPInputError naming the
    primitive, before any collective."""
    import types

    from cpcompile import primitives
    from cpcompile.errors import CPInputError

    cp = types.SimpleNamespace(cp_size=2, cp_rank=0, cp_group_name="never used")
    with pytest.raises(CPInputError, match=f"{primitive}: .* do not split over cp_size=2"):
        getattr(primitives, primitive)(torch.zeros(shape), cp)
