"""Packed sequences with SDPA CP: equal to running each document alone (issue 17, SDPA part).

A packed row holds documents of odd lengths — one of a single token, several crossing rank
boundaries — marked by position ids restarting at 0. Every method at CP=2 and 4 (Hybrid at 4)
equals the unrewritten model run on each document separately: logits, the global mean loss
(each document's last token predicting nothing) and every parameter gradient, fp32 ≤ 1e-5. And
a token moved in one document changes nothing in the logits of the others. Head-Tail cuts a packed
batch per document (`documents.per_document_head_tail`): two rows with different documents equal
the rows' documents run alone, through the per-document path, and the same compiled model still
runs an unpacked batch on its static chunks.
"""
from __future__ import annotations

import random

import pytest
import torch

from cp_harness import (
    HEAD_TAIL_WRAPPER, VOCAB, assert_equivalent, cp_outputs, each_document_alone, hybrid_wrapper, method_wrapper, rel,
    sdpa_plan, tiny_qwen3, two_forwards_one_backward,
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


def _rows_alone(model, batch: dict, spans_per_row) -> dict:
    """The reference for several packed rows: every document of every row alone, one global mean loss."""
    targets = sum(b - a - 1 for spans in spans_per_row for a, b in spans)
    logits, loss = [], 0.0
    for row, spans in enumerate(spans_per_row):
        pieces = []
        for a, b in spans:
            ids = batch["input_ids"][row:row + 1, a:b]
            out = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(targets), use_cache=False)
            pieces.append(out.logits.detach())
            loss = loss + out.loss
        logits.append(torch.cat(pieces, dim=1))
    loss.backward()
    return {"logits": torch.cat(logits), "loss": loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def _per_document_head_tail(rank: int, world: int, seed: int, dump: str) -> dict:
    import json
    import os

    import cpcompile

    rows = [packed_batch(seed, 12 * world), packed_batch(seed + 1, 12 * world)]
    batch = {k: torch.cat([r[0][k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}
    make = lambda: tiny_qwen3(seed)
    want = _rows_alone(make(), batch, [r[1] for r in rows])
    plan = cpcompile.load_plan(sdpa_plan(world, wrapper=HEAD_TAIL_WRAPPER))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(batch, mesh, plan)
    model = cpcompile.compile(make(), mesh, plan, example_inputs=local, dump_dir=dump)
    out = model(**local)
    out.loss.backward()
    cpcompile.all_reduce_gradients(model, mesh)
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss, group=mesh.cp_group)
    unpacked = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    plain = cpcompile.unshard(model(**cpcompile.shard_batch(unpacked, mesh, plan)).logits.detach(), mesh, plan)
    with torch.no_grad():
        plain_want = make()(**unpacked, use_cache=False).logits
    summary = json.load(open(os.path.join(dump, f"rank{rank}", "summary.json")))  # compile: one folder per rank
    return {"logits": rel(cpcompile.unshard(out.logits.detach(), mesh, plan, batch=local), want["logits"]),
            "loss": rel(loss, want["loss"]),
            "grads": {n: rel(p.grad, want["grads"][n]) for n, p in model.named_parameters()},
            "missing_grads": [], "compiled": True, "unpacked_logits": rel(plain, plain_want),
            "notes": [note for region in summary["regions"] for note in region["notes"]]}


@pytest.mark.parametrize("world", [2, 4])
def test_head_tail_cuts_two_packed_rows_per_document(world, tmp_path):
    for result in run_distributed(_per_document_head_tail, world, random.randrange(1 << 30), str(tmp_path),
                                  timeout=600):
        notes = result.pop("notes")
        assert any("per document" in note for note in notes), notes
        assert result.pop("unpacked_logits") <= 1e-5, result
        assert_equivalent(result)


def _interleaved_under_checkpointing(rank: int, world: int, seed: int) -> dict:
    """Two packed batches through one checkpointed Head-Tail model, both forwards before one
    backward: each layer's recompute must cut its own batch per document, not the latest one."""
    import cpcompile

    batches = [packed_batch(seed + i, 12 * world) for i in range(2)]

    def make():
        model = tiny_qwen3(seed)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    reference = make()
    want = [each_document_alone(reference, batch, spans) for batch, spans in batches]  # grads accumulate
    plan = cpcompile.load_plan(sdpa_plan(world, wrapper=HEAD_TAIL_WRAPPER))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    locals_ = [cpcompile.shard_batch(batch, mesh, plan) for batch, _ in batches]
    model = cpcompile.compile(make(), mesh, plan, example_inputs=locals_[0])
    return two_forwards_one_backward(model, mesh, locals_, reference, want)


def test_checkpoint_recompute_cuts_its_own_batch_per_document():
    for result in run_distributed(_interleaved_under_checkpointing, 2, random.randrange(1 << 30), timeout=300):
        assert_equivalent(result)


class _RebuildsPositions(torch.nn.Module):
    """A model whose forward hands its layers new position ids (as some multimodal models do)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, position_ids=position_ids.clone(), **kwargs)


def _rebuilt_positions(rank: int, world: int, seed: int) -> str:
    import cpcompile

    batch, _ = packed_batch(seed, 12 * world)
    plan = cpcompile.load_plan(sdpa_plan(world, wrapper=HEAD_TAIL_WRAPPER, match="inner.*.self_attn"))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(batch, mesh, plan)
    try:
        cpcompile.compile(_RebuildsPositions(tiny_qwen3(seed)), mesh, plan, example_inputs=local)
    except cpcompile.errors.CPInputError as exc:
        return str(exc)
    return "no error"


def test_per_document_head_tail_refuses_attention_without_the_marked_positions():
    for message in run_distributed(_rebuilt_positions, 2, random.randrange(1 << 30), timeout=300):
        assert "cut per document" in message and "position_ids shard_batch marked" in message, message
