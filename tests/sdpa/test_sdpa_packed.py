"""Packed sequences with SDPA CP: equal to running each document alone (issue 17, SDPA part).

A packed row holds documents of odd lengths — one of a single token, several crossing rank
boundaries — marked by position ids restarting at 0. Every method at CP=2 and 4 (Hybrid at 4)
equals the unrewritten model run on each document separately: logits, the global mean loss
(each document's last token predicting nothing) and every parameter gradient, fp32 ≤ 1e-5. And
a token moved in one document changes nothing in the logits of the others.
"""
from __future__ import annotations

import random

import pytest
import torch

from cp_harness import (
    HEAD_TAIL_WRAPPER, VOCAB, assert_equivalent, cp_outputs, each_document_alone, hybrid_wrapper, method_wrapper, rel,
    sdpa_plan, tiny_qwen3,
)
from dist_utils import run_distributed

METHODS = {
    "all_gather": ("sdpa_hf", (2, 4)), "ulysses": ("sdpa_hf_ulysses", (2, 4)), "head_tail": (HEAD_TAIL_WRAPPER, (2, 4)),
    "hybrid": (hybrid_wrapper(2), (4,)), "async_all_gather": (method_wrapper("all_gather", True), (2,)),
}


def packed_batch(seed: int, length: int) -> tuple[dict, list[tuple[int, int]]]:
    """One row of documents of random odd lengths (the first one token long), and their spans."""
    gen = torch.Generator().manual_seed(seed)
    spans, start = [], 0
    while start < length:
        size = 1 if not spans else min(2 * int(torch.randint(1, 9, (1,), generator=gen)) + 1, length - start)
        spans.append((start, start + size))
        start += size
    positions = torch.cat([torch.arange(b - a) for a, b in spans]).unsqueeze(0)
    ids = torch.randint(0, VOCAB, (1, length), generator=gen)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}, spans


def _equivalence(rank: int, world: int, seed: int, method: str) -> dict:
    batch, spans = packed_batch(seed, 12 * world)
    make = lambda: tiny_qwen3(seed)
    want = each_document_alone(make(), batch, spans)
    got = cp_outputs(make, batch, sdpa_plan(world, wrapper=METHODS[method][0]))
    return {"logits": rel(got["logits"], want["logits"]), "loss": rel(got["loss"], want["loss"]),
            "grads": {n: rel(got["grads"][n], g) for n, g in want["grads"].items()},
            "missing_grads": sorted(set(want["grads"]) - set(got["grads"])), "compiled": got["compiled"]}


@pytest.mark.parametrize("method, world", [(m, w) for m, (_, worlds) in METHODS.items() for w in worlds])
def test_packed_batch_equals_each_document_alone(method, world):
    for result in run_distributed(_equivalence, world, random.randrange(1 << 30), method, timeout=600):
        assert_equivalent(result)


def _leak(rank: int, world: int, seed: int) -> float:
    """Change one token of the second document; the largest change of any other document's logits."""
    batch, spans = packed_batch(seed, 12 * world)
    plan = sdpa_plan(world, wrapper="sdpa_hf")
    make = lambda: tiny_qwen3(seed)
    before = cp_outputs(make, batch, plan)["logits"]
    (a, b) = spans[1]
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][0, a] = (changed["input_ids"][0, a] + 1) % VOCAB
    after = cp_outputs(make, changed, plan)["logits"]
    others = torch.ones(batch["input_ids"].shape[1], dtype=torch.bool)
    others[a:b] = False
    assert not torch.equal(before[:, a:b], after[:, a:b]), "the changed document's logits did not change"
    return (before[:, others] - after[:, others]).abs().max().item()


def test_no_leak_across_documents():
    for leak in run_distributed(_leak, 2, random.randrange(1 << 30), timeout=300):
        assert leak == 0.0, leak
