"""SDPA rewrites read the model's attention configuration, not only the traced call (issue 12,
items 1 and 2): both cases below ran and gave silently wrong gradients.

1. Sliding windows. A window at least as long as a rank's shard looks purely causal on that
   shard (transformers then passes no mask), so the mask alone cannot tell. The module's
   `sliding_window` decides: a window shorter than the global sequence is refused; one covering
   it is plain causal attention, exactly.
2. One token per rank. transformers passes `is_causal = q_len > 1`, so with one local token and
   no mask the traced call says "not causal". The module's `is_causal` decides; a module that
   declares nothing is refused at local length 1. (`compile` refuses an example of one local
   token, on which its audits cannot watch other positions: the model is compiled on a longer
   example and traces the one-token call when it first runs it.)
"""
from __future__ import annotations

import random

import pytest
import torch

from cp_harness import (
    VOCAB, QKVHolder, assert_equivalent, assert_fails_with, compare_cp_run, outcome_of, random_batch, sdpa_plan,
    tiny_qwen3,
)
from dist_utils import run_distributed

WORLD = 2
_results: dict = {}


def sliding_qwen3(seed: int, window: int):
    """Every layer a sliding-window layer (`max_window_layers=0`)."""
    return tiny_qwen3(seed, use_sliding_window=True, sliding_window=window, max_window_layers=0)


class UndeclaredCausality(torch.nn.Module):
    """Calls SDPA the way transformers does (`is_causal = q_len > 1`), without an `is_causal` attribute."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)


def every_token_a_target(batch: dict) -> dict:
    """Targets given already shifted, one per token: with a 2-token sequence, shifting would leave
    only token 0 a target, and its attention (to itself alone) has no query or key gradient."""
    return dict(batch, shift_labels=batch["labels"].clone())


def distinct_tokens(batch: dict, seed: int) -> dict:
    """The batch with no token repeated within a row (padding kept). In a row of two equal tokens
    every value is equal, so the attention's output depends on no query or key: their gradients are
    exactly zero and the comparison would be of rounding noise (one seed in 96 drew that row)."""
    gen = torch.Generator().manual_seed(seed)
    rows, length = batch["input_ids"].shape
    ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:length] for _ in range(rows)])
    return dict(batch, input_ids=ids, labels=ids.masked_fill(batch["labels"] == -100, -100))


def _compile_sliding(seed: int, window: int, length: int):
    import cpcompile

    plan = cpcompile.load_plan(sdpa_plan(WORLD))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(random_batch(seed, 1, length, padded=False), mesh, plan)
    cpcompile.compile(sliding_qwen3(seed, window), mesh, plan, example_inputs=local)


def _compile_undeclared_one_token():
    import cpcompile

    plan = cpcompile.load_plan(sdpa_plan(WORLD, wrapper="sdpa_qkv", match="core"))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    longer = torch.randn(1, 2, 4, 8)
    holder = cpcompile.compile(QKVHolder(UndeclaredCausality()), mesh, plan, example_inputs=(longer,) * 3)
    q = torch.randn(1, 2, 1, 8)
    holder(q, q, q)


def _run_all(rank: int, world: int, seed: int) -> dict:
    plan = sdpa_plan(world)
    qwen = lambda: tiny_qwen3(seed)
    one_token = every_token_a_target(distinct_tokens(random_batch(seed + 1, 1, world, padded=False), seed + 1))
    longer = random_batch(seed + 3, 1, 4 * world, padded=False)
    return {
        "window_shorter_than_sequence": outcome_of(lambda: _compile_sliding(seed, window=8, length=16)),
        "window_covers_sequence": compare_cp_run(lambda: sliding_qwen3(seed, 16), random_batch(seed + 2, 2, 16, True), plan),
        "one_token_per_rank": compare_cp_run(qwen, one_token, plan, traced_with=longer),
        "one_token_per_rank_padded": compare_cp_run(
            qwen, every_token_a_target(distinct_tokens(random_batch(seed + 4, 2, world, padded=True), seed + 4)), plan,
            traced_with=random_batch(seed + 5, 2, 4 * world, padded=True)),
        "one_token_per_rank_ulysses": compare_cp_run(qwen, one_token, sdpa_plan(world, wrapper="sdpa_hf_ulysses"),
                                                     traced_with=longer),
        "undeclared_one_token": outcome_of(_compile_undeclared_one_token),
    }


def results() -> list:
    if not _results:
        _results["all"] = run_distributed(_run_all, WORLD, random.randrange(1 << 30), timeout=300)
    return _results["all"]


def test_sliding_window_shorter_than_the_sequence_is_refused():
    for result in results():
        assert_fails_with("window 8, 16 tokens", result["window_shorter_than_sequence"], "UnsupportedMaskError",
                          ["model.layers.0.self_attn", "sliding_window=8", "16 tokens", "sliding-window"])


def test_sliding_window_covering_the_sequence_is_exact():
    for result in results():
        assert_equivalent(result["window_covers_sequence"])


@pytest.mark.parametrize("scenario", ["one_token_per_rank", "one_token_per_rank_padded", "one_token_per_rank_ulysses"])
def test_one_token_per_rank_is_causal(scenario):
    for result in results():
        assert_equivalent(result[scenario])


def test_undeclared_causality_at_local_length_one_is_refused():
    for result in results():
        assert_fails_with("undeclared", result["undeclared_one_token"], "CPInputError",
                          ["core", "local sequence length 1", "is_causal"])


def test_declared_window_is_read_per_layer_from_the_module_or_its_config():
    from transformers import MistralConfig, MistralForCausalLM

    from cpcompile.adapters.sdpa import SdpaRegion

    def declared(layer):
        return SdpaRegion().declared_attention("attn", layer.self_attn)

    mixed = tiny_qwen3(0, use_sliding_window=True, sliding_window=8, max_window_layers=1)  # layer 0 full, 1 sliding
    assert [declared(layer).window for layer in mixed.model.layers] == [None, 8]
    assert declared(mixed.model.layers[0]).causal is True
    mistral = MistralForCausalLM(MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                               sliding_window=6, attn_implementation="sdpa"))
    assert not hasattr(mistral.model.layers[0].self_attn, "sliding_window")  # read from its config
    assert declared(mistral.model.layers[0]).window == 6
    whole_layer = SdpaRegion().declared_attention("model.layers.1", mixed.model.layers[1])
    assert (whole_layer.window, whole_layer.window_module) == (8, "model.layers.1.self_attn")
