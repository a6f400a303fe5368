"""Fail-fast rules of `cpcompile.compile`: each raises before anything runs, naming its cause.

All checks run in one child process under the fake process group (cp=2), since none of
them may communicate; each test below asserts one rule on the recorded outcome.
"""
from __future__ import annotations

import pytest
import torch

from cp_harness import outcome_of, QKVHolder, assert_fails_with, random_batch, sdpa_plan, tiny_qwen3
from dist_utils import run_distributed

_outcomes: dict = {}





def _all_checks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = cpcompile.build_mesh(cpcompile.load_plan(sdpa_plan(2)).accelerator, device_type="cpu")
    local = {"input_ids": torch.randint(0, 96, (1, 8)), "position_ids": torch.arange(8)[None], "use_cache": False}

    def compile_with(plan, model=None, example=local):
        return cpcompile.compile(model or tiny_qwen3(0), mesh, plan, example_inputs=example)

    def plan_with(*matches):
        plan = sdpa_plan(2)
        plan["plan_overrides"] = [dict(plan["plan_overrides"][0], match=m) for m in matches]
        return plan

    def twice():
        model = compile_with(sdpa_plan(2))
        compile_with(sdpa_plan(2), model=model)

    def with_cache():
        model = compile_with(sdpa_plan(2))
        model(input_ids=local["input_ids"], position_ids=torch.arange(8)[None], use_cache=True)  # rank 0's slice

    def sliding_window():
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                             sliding_window=3, max_window_layers=0, attn_implementation="sdpa")
        model = Qwen3ForCausalLM(config)
        batch = random_batch(0, 2, 8, padded=True)
        compile_with(sdpa_plan(2), model=model, example={"input_ids": batch["input_ids"],
                                                          "attention_mask": batch["attention_mask"],
                                                          "position_ids": torch.arange(8)[None], "use_cache": False})

    def eager_attention():
        model = tiny_qwen3(0)
        model.config._attn_implementation = "eager"
        compile_with(sdpa_plan(2), model=model)

    def cross_lengths():
        holder = QKVHolder()
        q, kv = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
        cpcompile.compile(holder, mesh, sdpa_plan(2, wrapper="sdpa_qkv", match="core"), example_inputs=(q, kv, kv))

    def not_hf_without_example():
        holder = QKVHolder()
        cpcompile.compile(holder, mesh, sdpa_plan(2, wrapper="sdpa_qkv", match="core"))

    def blank_overrides_line():  # `plan_overrides:` with nothing after it is YAML null
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
            handle.write("accelerator: {cp_size: 2}\nplan_overrides:\n")
        compile_with(handle.name)

    checks = {
        "empty_plan": lambda: compile_with(dict(sdpa_plan(2), plan_overrides=[])),
        "blank_plan": blank_overrides_line,
        "matches_nothing": lambda: compile_with(plan_with("*.attention", "lm_head.*")),
        "uncovered": lambda: compile_with(plan_with("model.layers.0.self_attn")),
        "doubly_covered": lambda: compile_with(plan_with("*.self_attn", "model.layers.0.*")),
        "nested": lambda: compile_with(plan_with("*.self_attn", "model.layers.0")),
        "no_match": lambda: compile_with(plan_with("*.attention")),
        "twice": twice,
        "cp_size_mismatch": lambda: compile_with(sdpa_plan(4)),
        "tp_not_applied": lambda: compile_with(dict(sdpa_plan(2), accelerator={"cp_size": 2, "tp_size": 2})),
        "inference_cache": with_cache,
        "sliding_window": sliding_window,
        "eager_attention": eager_attention,
        "cross_lengths": cross_lengths,
        "not_hf_without_example": not_hf_without_example,
        "example_without_positions": lambda: compile_with(sdpa_plan(2), example={"input_ids": local["input_ids"]}),
        "one_token_example": lambda: compile_with(sdpa_plan(2), example={"input_ids": local["input_ids"][:, :1],
                                                                         "position_ids": torch.arange(1)[None]}),
    }
    results = {name: outcome_of(fn) for name, fn in checks.items()}

    untouched = tiny_qwen3(0)
    plan1 = cpcompile.load_plan(sdpa_plan(1))
    results["cp1_untouched"] = outcome_of(
        lambda: cpcompile.compile(untouched, _Cp1Mesh(), plan1)
    )
    results["cp1_forward_is_original"] = all("forward" not in vars(m) for m in untouched.modules())
    dist.destroy_process_group()
    return results


class _Cp1Mesh:
    cp_size = 1


def outcome(name):
    if not _outcomes:
        (_outcomes["all"],) = run_distributed(_all_checks, 1, init_pg=False, timeout=300)
    return _outcomes["all"][name]


@pytest.mark.parametrize("name, error, words", [
    ("empty_plan", "CoverageError", ["cp_size=2", "no plan_overrides"]),
    ("blank_plan", "CoverageError", ["cp_size=2", "no plan_overrides"]),
    ("matches_nothing", "PlanError", ["plan_overrides[0].match", "matches no module"]),
    ("uncovered", "CoverageError", ["model.layers.1.self_attn", "not covered"]),
    ("doubly_covered", "PlanError", ["model.layers.0.self_attn", "also matched"]),
    ("nested", "PlanError", ["model.layers.0.self_attn", "inside", "model.layers.0"]),
    ("no_match", "PlanError", ["plan_overrides[0].match", "matches no module"]),
    ("twice", "AlreadyCompiledError", ["already compiled"]),
    ("cp_size_mismatch", "CPConfigError", ["cp_size=4", "size 2"]),
    ("tp_not_applied", "UnsupportedError", ["accelerator.tp_size=2", "no parameter", "tensor parallelism first"]),
    ("inference_cache", "CPInputError", ["use_cache=False", "cache"]),
    ("sliding_window", "UnsupportedMaskError", ["sliding-window"]),
    ("eager_attention", "CoverageError", ["ran no sdpa core", "attn_implementation='eager'",
                                          'attn_implementation="sdpa"']),
    ("cross_lengths", "CPInputError", ["4 queries but 6 keys"]),
    ("not_hf_without_example", "CPInputError", ["example_inputs"]),
    ("example_without_positions", "CPInputError", ["no position_ids", "Qwen3ForCausalLM", "shard_batch"]),
    ("one_token_example", "CPInputError", ["1 local token a row", "at least 2", "example_inputs"]),
])
def test_fail_fast_rule(name, error, words):
    assert_fails_with(name, outcome(name), error, words)


def test_cp1_leaves_the_model_untouched():
    assert outcome("cp1_untouched") is None
    assert outcome("cp1_forward_is_original")
