"""Issue 52 item 1: a suggested plan, written as YAML and loaded back, is exact against one process
(logits, loss, every gradient) for Llama, Qwen3 and Qwen3.5 at CP=2 and 4, on padded batches,
whichever methods the rules chose (the lengths below make them choose each one somewhere)."""
from __future__ import annotations

import random

import pytest
import torch
import yaml

from cp_harness import assert_equivalent, compare_cp_run, qwen3_with_heads, random_batch, tiny_llama, tiny_qwen3
from dist_utils import run_distributed
from gdn_harness import TWO_LAYERS, tiny_qwen3_5, use_reference_gdn

LENGTH = 32  # at CP=4 under Head-Tail: chunks of 4 tokens, not shorter than the GDN conv halo (3)
# (model, the length the plan is suggested for): long sequences make causal attention dominate
# (Head-Tail, or Ulysses where the heads split cheaply), short ones leave the ranks balanced (AllGather)
CASES = {
    "llama": (lambda seed: tiny_llama(seed), 32768),
    "qwen3 short": (lambda seed: tiny_qwen3(seed), 64),
    "qwen3 8 KV heads": (lambda seed: qwen3_with_heads(seed, 8, 8), 32768),
    # float64 with cpcompile's GDN statement as the reference (gdn_harness.use_reference_gdn)
    # one GDN and one attention layer (TWO_LAYERS): a choice for each kind of layer, half the traces
    "qwen3_5": (lambda seed: use_reference_gdn(tiny_qwen3_5(seed, torch.float64, **TWO_LAYERS)), 32768),
    "qwen3_5 short": (lambda seed: use_reference_gdn(tiny_qwen3_5(seed, torch.float64, **TWO_LAYERS)), 64),
}


def _run(rank: int, world: int, seed: int) -> dict:
    import cpcompile

    out = {}
    for i, (name, (make, seq_len)) in enumerate(CASES.items()):
        suggestion = cpcompile.suggest_plan(make(seed), world, seq_len)
        plan = yaml.safe_load(suggestion.text)  # the YAML a user would save, loaded back
        methods = sorted({choice.method for choice in suggestion.decision.choices})
        out[name] = (methods, compare_cp_run(lambda: make(seed), random_batch(seed + i, 2, LENGTH, True), plan))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_suggested_plans_are_exact(world):
    results = run_distributed(_run, world, random.randrange(1 << 30), timeout=300)
    chosen = set()
    for name, (methods, result) in results[0].items():
        chosen |= set(methods)
        try:
            # float64 Qwen3.5 keeps its fp32 casts (q/k norm, decay): within 1e-6 (tests/gdn/test_gdn_equivalence.py)
            assert_equivalent(result, tol=1e-6 if "qwen3_5" in name else 1e-5)
        except AssertionError as exc:
            raise AssertionError(f"{name} ({methods}) at CP={world}: {exc}") from exc
    expected = {"all_gather", "head_tail", "p2p", "p2p_head_tail"} | ({"ulysses"} if world == 4 else set())
    assert expected <= chosen, chosen
