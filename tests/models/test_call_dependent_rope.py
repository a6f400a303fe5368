"""RoPE whose frequencies depend on the call (issue 30, item 2): exact under every method, or refused.

Before: Llama's `dynamic` (NTK) RoPE and Phi-3's `longrope` picked their frequencies from each
rank's own `max(position_ids)`, so above the trained length (`max_position_embeddings` /
`original_max_position_embeddings`, 20 here) ranks used different frequencies: logits 2e-4 to
2e-3 and gradients 3e-2 to 7e-2 relative off one process, no error (dynamic: AllGather, Ulysses
and Head-Tail at CP=2; longrope: AllGather and Ulysses at CP=2). Now `compile` wraps those rotary
modules: the frequencies come from the step's global longest position (one scalar max
all-reduce), chosen by transformers' own update, the same on every rank. Other call-dependent
RoPE types are refused by name.

Two launches, CP=2 (with the refusal) and CP=4: every method on 32 tokens (above the trained
length), AllGather also on 16 (below it).
"""
from __future__ import annotations

import random

import pytest

from cp_harness import (
    HEAD_TAIL_WRAPPER, assert_equivalent, assert_fails_with, compare_cp_run, hybrid_wrapper, outcome_of, random_batch,
    sdpa_plan,
)
from dist_utils import run_distributed
from model_zoo import build

TRAINED = 20  # the length each model was "trained" at: 16 tokens lie below it, 32 above
LENGTHS = (16, 32)
_results: dict = {}


def dynamic_llama(seed: int):
    return build("llama", seed, max_position_embeddings=TRAINED,
                 rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})


def longrope_phi3(seed: int):
    return build("phi3", seed, max_position_embeddings=64, original_max_position_embeddings=TRAINED,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.2, 1.3],
                                  "long_factor": [2.0, 3.0, 5.0, 8.0], "original_max_position_embeddings": TRAINED})


MODELS = {"dynamic": dynamic_llama, "longrope": longrope_phi3}


def methods(world: int) -> dict:
    chosen = {"all_gather": "sdpa_hf", "ulysses": "sdpa_hf_ulysses", "head_tail": HEAD_TAIL_WRAPPER}
    if world == 4:
        chosen["hybrid"] = hybrid_wrapper(2)
    return chosen


def _compile_with_rope_type(seed: int, world: int, rope_type: str) -> None:
    import cpcompile

    model = dynamic_llama(seed)
    model.model.rotary_emb.rope_type = rope_type
    plan = cpcompile.load_plan(sdpa_plan(world))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    cpcompile.compile(model, mesh, plan, example_inputs=cpcompile.shard_batch(random_batch(seed, 1, 16, False), mesh, plan))


def _dumped_hazards(seed: int, world: int) -> list:
    import json
    import tempfile

    import cpcompile
    from cpcompile.dump import resolve_dump_dir

    plan = cpcompile.load_plan(sdpa_plan(world))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    with tempfile.TemporaryDirectory() as dump:
        local = cpcompile.shard_batch(random_batch(seed, 1, 16, False), mesh, plan)
        cpcompile.compile(dynamic_llama(seed), mesh, plan, example_inputs=local, dump_dir=dump)
        with open(resolve_dump_dir(dump) / "summary.json") as summary:  # this rank's folder
            return json.load(summary)["model"]["hazards"]


def _run(rank: int, world: int, seed: int) -> dict:
    out = {}
    for rope, make in MODELS.items():
        for name, wrapper in methods(world).items():
            for length in LENGTHS if name == "all_gather" else LENGTHS[1:]:
                batch = random_batch(seed + length, 1, length, padded=False)
                out[(rope, name, length)] = compare_cp_run(lambda: make(seed), batch, sdpa_plan(world, wrapper=wrapper))
    if world == 2:
        out["unknown_type"] = outcome_of(lambda: _compile_with_rope_type(seed, world, "mystery_scaling"))
        out["dump"] = _dumped_hazards(seed, world)
    return out


def results(world: int) -> list:
    if world not in _results:
        _results[world] = run_distributed(_run, world, random.randrange(1 << 30), timeout=300)
    return _results[world]


def scenarios(world: int) -> list:
    return [(world, rope, name, length) for rope in MODELS for name in methods(world)
            for length in (LENGTHS if name == "all_gather" else LENGTHS[1:])]


@pytest.mark.parametrize("world, rope, method, length", scenarios(2) + scenarios(4))
def test_call_dependent_rope_is_exact(world, rope, method, length):
    for result in results(world):
        assert_equivalent(result[(rope, method, length)])


def test_an_unknown_rope_type_is_refused_on_every_rank():
    for rank, result in enumerate(results(2)):
        assert_fails_with(f"rank {rank}", result["unknown_type"], "UnsupportedError",
                          ["model.rotary_emb", "LlamaRotaryEmbedding", "mystery_scaling", "dynamic", "longrope"])


def test_the_dump_names_how_the_rope_type_was_handled():
    hazards = {(h["feature"], h["value"], h["where"]): h["handling"] for h in results(2)[0]["dump"]}
    assert "step's global longest position" in hazards["rope_type", "dynamic", "model.rotary_emb"]
