"""Tensor parallelism + context parallelism for SDPA models (issue 18, part 1).

4 gloo ranks as tp 2 x cp 2: PyTorch's own TP (`parallelize_module`, ColwiseParallel on q/k/v and
the MLP's gate/up, RowwiseParallel on o and down) applied first, then `cpcompile.compile`. Logits,
loss and every gradient (DTensor gradients gathered to full tensors) equal the single-process
model, for AllGather, Ulysses and Head-Tail, with and without padding. The ordering rule and the
TP-local head rule fail with messages naming their cause.
"""
from __future__ import annotations

import random

import pytest
import torch

import cpcompile
from cp_harness import (
    HEAD_TAIL_WRAPPER, assert_fails_with, outcome_of, qwen3_with_heads, random_batch, reference_run, rel, tiny_qwen3,
)
from dist_utils import run_distributed

WRAPPERS = {"all_gather": "sdpa_hf", "ulysses": "sdpa_hf_ulysses", "head_tail": HEAD_TAIL_WRAPPER}
TOL = 1e-5
_cache: dict = {}


def tp_cp_plan(wrapper) -> dict:
    return {"accelerator": {"cp_size": 2, "tp_size": 2}, "plan_overrides": [
        {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self", "inner_wrapper": wrapper}]}


def apply_tp(model, mesh, *, attention: bool = True, mlp: bool = True, instead: dict | None = None):
    """PyTorch TP over the cpcompile mesh's tp dimension, Megatron style (`instead`: other styles
    for some modules)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {}
    for i in range(len(model.model.layers)):
        if attention:
            styles.update({f"model.layers.{i}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
            styles[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        if mlp:
            styles.update({f"model.layers.{i}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
            styles[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh.root["tp"], {**styles, **(instead or {})})


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def tp_cp_errors(seed: int, wrapper, batch: dict) -> dict:
    plan = cpcompile.load_plan(tp_cp_plan(wrapper))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    ref_logits, ref_loss, ref_grads = reference_run(lambda: tiny_qwen3(seed), batch)
    local = cpcompile.shard_batch(batch, mesh, plan)
    model = cpcompile.compile(apply_tp(tiny_qwen3(seed), mesh), mesh, plan, example_inputs=local)
    out = model(**local)
    out.loss.backward()
    cpcompile.all_reduce_gradients(model, mesh)  # over dp_cp; a DTensor gradient's local shard
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss, group=mesh.cp_group)
    grads = {n: rel(full(p.grad), ref_grads[n]) for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": rel(cpcompile.unshard(out.logits.detach(), mesh, plan), ref_logits),
            "loss": rel(loss, ref_loss), "grads": grads, "missing": sorted(set(ref_grads) - set(grads)),
            "dtensor_grads": sum(hasattr(p.grad, "full_tensor") for p in model.parameters())}


def _run(rank: int, world: int, seed: int) -> dict:
    results = {}
    for name, wrapper in WRAPPERS.items():
        results[name, "padded"] = tp_cp_errors(seed, wrapper, random_batch(seed + 1, 2, 8, padded=True))
    # batch 1 without padding: transformers calls SDPA with is_causal and KV at the KV-head count
    results["all_gather", "unpadded"] = tp_cp_errors(seed, "sdpa_hf", random_batch(seed + 2, 1, 8, padded=False))

    plan = cpcompile.load_plan(tp_cp_plan("sdpa_hf_ulysses"))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(random_batch(seed, 1, 8, padded=False), mesh, plan)

    def ulysses_local_heads():  # 6 query heads over tp 2: 3 on each rank, not divisible by cp 2
        cpcompile.compile(apply_tp(qwen3_with_heads(seed, 6, 2), mesh), mesh, plan, example_inputs=local)

    def tp_after_compile():
        model = cpcompile.compile(apply_tp(tiny_qwen3(seed), mesh, attention=False), mesh, plan, example_inputs=local)
        apply_tp(model, mesh, mlp=False)
        model(**local)

    def sequence_parallel_output():
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import RowwiseParallel

        sequence_parallel = {"model.layers.0.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1))}
        cpcompile.compile(apply_tp(tiny_qwen3(seed), mesh, instead=sequence_parallel), mesh, plan, example_inputs=local)

    def replicated_norm():
        from torch.distributed.tensor import distribute_module

        model = apply_tp(tiny_qwen3(seed), mesh)
        distribute_module(model.model.layers[0].self_attn.q_norm, mesh.root["tp"])
        cpcompile.compile(model, mesh, plan, example_inputs=local)

    def other_mesh():  # TP over the cp dimension instead of tp
        cpcompile.compile(apply_tp(tiny_qwen3(seed), type("M", (), {"root": {"tp": mesh.root["cp"]}})()),
                          mesh, plan, example_inputs=local)

    def fsdp_before_compile():  # no TP: dp_shard 2 x cp 2, fully_shard first
        from torch.distributed.fsdp import fully_shard

        dp_plan = cpcompile.load_plan(dict(tp_cp_plan("sdpa_hf"), accelerator={"cp_size": 2, "dp_shard_size": 2}))
        dp_mesh = cpcompile.build_mesh(dp_plan.accelerator, device_type="cpu")
        model = tiny_qwen3(seed)
        fully_shard(model, mesh=dp_mesh.dp_cp)
        cpcompile.compile(model, dp_mesh, dp_plan, example_inputs=cpcompile.shard_batch(batch, dp_mesh, dp_plan))

    batch = random_batch(seed, 1, 8, padded=False)
    results["fsdp_before_compile"] = outcome_of(fsdp_before_compile)
    results["sequence_parallel_output"] = outcome_of(sequence_parallel_output)
    results["replicated_norm"] = outcome_of(replicated_norm)
    results["other_mesh"] = outcome_of(other_mesh)
    results["ulysses_local_heads"] = outcome_of(ulysses_local_heads)
    results["tp_after_compile"] = outcome_of(tp_after_compile)
    return results


def results() -> list[dict]:
    if "all" not in _cache:
        _cache["all"] = run_distributed(_run, 4, random.randrange(1 << 30), timeout=600)
    return _cache["all"]


@pytest.mark.parametrize("method, padding", [(m, "padded") for m in WRAPPERS] + [("all_gather", "unpadded")])
def test_tp2_cp2_matches_single_process(method, padding):
    for rank_result in results():
        got = rank_result[method, padding]
        assert not got["missing"], f"parameters without gradient: {got['missing']}"
        assert got["dtensor_grads"] > 0, "no parameter was tensor-parallel"
        assert got["logits"] <= TOL, f"logits rel err {got['logits']:.3g}"
        assert got["loss"] <= TOL, f"loss rel err {got['loss']:.3g}"
        worst = max(got["grads"], key=got["grads"].get)
        assert got["grads"][worst] <= TOL, f"gradient of {worst}: rel err {got['grads'][worst]:.3g}"


def test_ulysses_counts_tp_local_heads():
    for rank_result in results():
        assert_fails_with("ulysses_local_heads", rank_result["ulysses_local_heads"], "CPInputError",
                          ["3 TP-local query heads", "6 over tp_size=2", "cp_size=2", "sdpa_hf"])


def test_tp_applied_after_compile_is_refused():
    for rank_result in results():
        assert_fails_with("tp_after_compile", rank_result["tp_after_compile"], "UnsupportedError",
                          ["became a DTensor", "tensor parallelism first", "then cpcompile.compile"])


@pytest.mark.parametrize("name, error, words", [
    ("sequence_parallel_output", "UnsupportedError",
     ["model.layers.0.self_attn.o_proj", "RowwiseParallel", "default layouts", "sequence parallel"]),
    ("replicated_norm", "UnsupportedError", ["model.layers.0.self_attn.q_norm", "Qwen3RMSNorm", "only nn.Linear"]),
    ("fsdp_before_compile", "UnsupportedError", ["q_proj", "tp_size=1", "FSDP applied before compile", "then FSDP"]),
    ("other_mesh", "CPConfigError", ["model.layers.0.self_attn.q_proj", "not this rank's tp group", "mesh.root['tp']"]),
])
def test_dtensor_layout_cpcompile_cannot_trace_is_refused(name, error, words):
    for rank_result in results():
        assert_fails_with(name, rank_result[name], error, words)


def _opcheck(rank: int, world: int) -> None:
    import cpcompile.tp  # noqa: F401  (registers the ops)

    x = torch.randn(3, 4, requires_grad=True)
    for op in (torch.ops.cpcompile.tp_copy, torch.ops.cpcompile.tp_reduce):
        torch.library.opcheck(op, (x, torch.distributed.group.WORLD.group_name))


def test_tp_custom_ops_pass_opcheck():
    run_distributed(_opcheck, 1, timeout=120)
