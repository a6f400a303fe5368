"""`cpcompile.compile` on a model whose parameters are on the meta device (cpcompile/meta_params.py):
what a pretrained model loaded shard by shard is built as, so that no rank holds all of it.

- The rewrite is the same as from real parameters: the same regions and methods, each region's
  rewritten graph (its code) and the parameters it reads; the mask checks read the batch's real
  mask (Qwen3 with padding: an explicit mask, classified by value), the GDN regions (Qwen3.5,
  State-P2P, tied nothing) and the SDPA ones alike.
- The parameters are still the meta ones afterwards (the same objects, no storage), and once
  given storage and the real model's values, forward and backward are the real-built compiled
  model's bit for bit.
- The audit for sequence mixing still runs (on random stand-ins): a running sum outside the
  regions is refused on a meta model as on a real one.
- A module outside the regions that reads another module's parameter has no stand-in values for
  it: refused, naming the module. A model whose buffers are on meta too, and a meta model
  without `example_inputs`, are refused naming the cause.

One launch of 2 gloo ranks.
"""
from __future__ import annotations

import random

import pytest
import torch

from cp_harness import RunningSum, assert_fails_with, outcome_of, random_batch, sdpa_plan, tiny_qwen3
from dist_utils import run_distributed
from gdn_harness import gdn_plan, tiny_qwen3_5

WORLD = 2
LENGTH = 16


class ReadsTheEmbedding(torch.nn.Module):
    """An MLP adding the first row of the embedding table, a parameter of another module."""

    def __init__(self, mlp: torch.nn.Module, embedding: torch.nn.Embedding):
        super().__init__()
        self.mlp = mlp
        self.embedding = [embedding]  # not a submodule: the table stays the embedding's

    def forward(self, hidden_states):
        return self.mlp(hidden_states) + self.embedding[0].weight[0]


def _on_meta(make_model):
    from cpcompile.trainer.weights import parameters_on_meta

    with parameters_on_meta():
        return make_model()


def _rewrite(model) -> list:
    """Per region: its FQN, method, each traced graph's code and the (module, attribute) each
    parameter placeholder reads, in the model's own names."""
    names = {module: name for name, module in model.named_modules()}
    regions = []
    for name, module in model.named_modules():
        mark = getattr(module, "_cpcompile_config", None)
        if mark is None:
            continue
        programs = list(module.forward.__self__.programs.values())
        state = [[(names[ref[0]], ref[1]) if isinstance(ref, tuple) else "constant" for ref in p.state]
                 for p in programs]
        regions.append((name, mark["method"], [p.gm.code for p in programs], state))
    return regions


def _step(model, local: dict) -> dict:
    out = model(**local)
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def _compare(make_model, batch: dict, plan_dict: dict) -> dict:
    import cpcompile
    from cpcompile.trainer.weights import materialize

    plan = cpcompile.load_plan(plan_dict)
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(batch, mesh, plan)
    real = cpcompile.compile(make_model(), mesh, plan, example_inputs=local)
    meta = _on_meta(make_model)
    before = {name: id(p) for name, p in meta.named_parameters()}
    cpcompile.compile(meta, mesh, plan, example_inputs=local)
    result = {"real": _rewrite(real), "meta": _rewrite(meta),
              "still_meta": all(p.is_meta for p in meta.parameters()),
              "same_objects": before == {name: id(p) for name, p in meta.named_parameters()}}
    materialize(meta, "cpu")
    meta.load_state_dict(real.state_dict())
    got, want = _step(meta, local), _step(real, local)
    result["same_loss"] = torch.equal(got["loss"], want["loss"])
    result["same_logits"] = torch.equal(got["logits"], want["logits"])
    result["different_grads"] = sorted(n for n, g in want["grads"].items() if not torch.equal(got["grads"][n], g))
    return result


def _compile_meta(make_model, plan_dict: dict, batch: dict | None):
    import cpcompile

    plan = cpcompile.load_plan(plan_dict)
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    example = cpcompile.shard_batch(batch, mesh, plan) if batch is not None else None
    cpcompile.compile(make_model(), mesh, plan, example_inputs=example)


def _with_running_sum(seed: int):
    model = tiny_qwen3(seed)
    model.model.layers[1].mlp = RunningSum(model.model.layers[1].mlp)
    return model


def _reading_the_embedding(seed: int):
    model = tiny_qwen3(seed)
    model.model.layers[1].mlp = ReadsTheEmbedding(model.model.layers[1].mlp, model.model.embed_tokens)
    return model


def _fully_on_meta(seed: int):
    with torch.device("meta"):
        return tiny_qwen3(seed)


def _run(rank: int, world: int, seed: int) -> dict:
    results = {
        "qwen3_5_gdn_p2p": _compare(lambda: tiny_qwen3_5(seed), random_batch(seed + 1, 2, LENGTH, padded=True),
                                    gdn_plan(world, "p2p", sdpa="sdpa_hf")),
        "qwen3_all_gather_padded": _compare(lambda: tiny_qwen3(seed), random_batch(seed + 2, 2, LENGTH, padded=True),
                                            sdpa_plan(world)),
        "qwen3_ulysses": _compare(lambda: tiny_qwen3(seed), random_batch(seed + 3, 1, LENGTH, padded=False),
                                  sdpa_plan(world, wrapper="sdpa_hf_ulysses")),
    }
    batch = random_batch(seed + 4, 2, LENGTH, padded=False)
    results["running_sum"] = outcome_of(lambda: _compile_meta(lambda: _on_meta(lambda: _with_running_sum(seed)),
                                                              sdpa_plan(world), batch))
    results["foreign_parameter"] = outcome_of(lambda: _compile_meta(lambda: _on_meta(lambda: _reading_the_embedding(seed)),
                                                                    sdpa_plan(world), batch))
    results["meta_buffers"] = outcome_of(lambda: _compile_meta(lambda: _fully_on_meta(seed), sdpa_plan(world), batch))
    results["no_example"] = outcome_of(lambda: _compile_meta(lambda: _on_meta(lambda: tiny_qwen3(seed)),
                                                             sdpa_plan(world), None))
    return results


_results: dict = {}


def results() -> list:
    if not _results:
        _results["all"] = run_distributed(_run, WORLD, random.randrange(1 << 30), timeout=300)
    return _results["all"]


SCENARIOS = ["qwen3_5_gdn_p2p", "qwen3_all_gather_padded", "qwen3_ulysses"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_rewrite_of_a_meta_model_is_the_real_models(scenario):
    for rank, result in enumerate(results()):
        got = result[scenario]
        assert got["real"], f"rank {rank}: nothing was rewritten"
        assert [r[:2] for r in got["meta"]] == [r[:2] for r in got["real"]], f"rank {rank}: regions or methods differ"
        for meta, real in zip(got["meta"], got["real"]):
            assert real[2], f"rank {rank}: {real[0]} holds no traced graph"
            assert meta[2] == real[2], f"rank {rank}: {real[0]}: the rewritten graph differs"
            assert meta[3] == real[3], f"rank {rank}: {real[0]}: the graph reads other parameters"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_meta_model_stays_on_meta_and_then_trains_as_the_real_one(scenario):
    for rank, result in enumerate(results()):
        got = result[scenario]
        assert got["still_meta"] and got["same_objects"], f"rank {rank}: compile left other parameters behind"
        assert got["same_loss"] and got["same_logits"], f"rank {rank}: the forward differs"
        assert not got["different_grads"], f"rank {rank}: gradients differ: {got['different_grads']}"


def test_the_mixing_audit_runs_on_a_meta_model():
    for rank, result in enumerate(results()):
        assert_fails_with(f"running sum on meta (rank {rank})", result["running_sum"], "CoverageError",
                          ["model.layers.1.mlp (RunningSum)", "mix positions", "later"])


def test_a_module_reading_another_modules_parameters_cannot_be_audited_on_meta():
    for rank, result in enumerate(results()):
        assert_fails_with(f"foreign parameter (rank {rank})", result["foreign_parameter"], "UnsupportedError",
                          ["model.layers.1.mlp", "another module's parameters", "real parameters"])


def test_meta_buffers_and_a_missing_example_are_refused():
    for rank, result in enumerate(results()):
        assert_fails_with(f"meta buffers (rank {rank})", result["meta_buffers"], "CPInputError",
                          ["rotary_emb.inv_freq", "meta device", "parameters_on_meta"])
        assert_fails_with(f"no example (rank {rank})", result["no_example"], "CPInputError",
                          ["meta device", "example_inputs="])
