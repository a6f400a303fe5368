"""The triton backend of GDN State-P2P in Head-Tail order (`cpcompile::gdn_p2p_head_tail_chunk`), in
Triton's CPU interpreter (`TRITON_INTERPRET=1`), on 3 gloo ranks: the middle rank receives and sends
in both directions, up the heads and down the tails.

- the op: each rank's two fragments (folded into the batch, two rows each) against the eager core
  on the whole sequence — outputs and every input gradient — and `torch.library.opcheck`;
- a tiny Qwen3.5 (one GDN layer, head dims 16, and one attention layer) on a packed row (a document
  starting exactly at a fragment edge, documents crossing fragment edges between ranks, one shorter
  than the conv kernel), its GDN layer on triton State-P2P in Head-Tail order beside SDPA Head-Tail,
  fp32, against the unrewritten model (eager core) on each document alone.

All of it in one launch.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")

from cp_harness import cp_outputs, each_document_alone, rel  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from gdn_harness import (  # noqa: E402
    DECAY_PARAMS, TEXT, VOCAB, assert_decay_as_close_as_reference, decay_vs_truth, gdn_wrapper, use_reference_gdn,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")

WORLD = 3
CHUNK = 64  # the Triton kernels' only chunk size
FRAGMENT = 24  # tokens per fragment: less than one chunk
# Packed row of 6 fragments of 24: starts at 0, 10, 30, 48 (a fragment edge), 75, 78, 83; documents
# cross the edges 24, 72 (rank 2's head into its own tail), 96 and 120; one is 3 tokens long.
DOCUMENTS = (10, 20, 18, 27, 3, 5, 61)


def _op_inputs(batch: int, length: int, heads: int, seed: int) -> list[torch.Tensor]:
    """q, k (L2-normalised), v, g, beta of `batch` rows; weak decay and small write strengths keep
    the transition products far from zero, so a wrong state or state gradient shows in every later
    fragment."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, length, 1, 16, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(batch, length, heads, 16, generator=gen)
    g = -0.02 * torch.rand(batch, length, heads, generator=gen)
    beta = 0.1 * torch.rand(batch, length, heads, generator=gen)
    return [q, k, v, g, beta]


def _op_body(rank: int, world: int, seed: int) -> dict:
    """The op on this rank's fragments (two rows each) vs the eager core on the whole sequence."""
    import torch.distributed as dist

    ops = torch.ops.cpcompile
    inputs = _op_inputs(2, 2 * world * FRAGMENT, 1, seed)
    d_o = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(seed + 1))
    full = [x.clone().requires_grad_() for x in inputs]
    o_ref = ops.gdn_chunk(*full, None, 0.25, CHUNK, "eager")
    (o_ref * d_o).sum().backward()

    chunks = [slice(c * FRAGMENT, (c + 1) * FRAGMENT) for c in (rank, 2 * world - 1 - rank)]
    fold = lambda x: torch.cat([x[:, c] for c in chunks])  # noqa: E731  heads' rows, then tails'
    local = [fold(x).clone().requires_grad_() for x in inputs]
    group = dist.group.WORLD.group_name
    o, _ = ops.gdn_p2p_head_tail_chunk(*local, 0.25, CHUNK, group, rank, world)
    (o * fold(d_o)).sum().backward()
    errors = {"o": rel(o, fold(o_ref))}
    errors.update({f"d{n}": rel(a.grad, fold(b.grad)) for n, a, b in zip(("q", "k", "v", "g", "beta"), local, full)})
    # every rank runs the same opcheck sequence, so each of its calls' sends meets its receive; the
    # tiniest shape (the interpreter's AOT-dispatch check alone runs the op several times)
    tiny = [x.requires_grad_() for x in _op_inputs(2, 8, 1, seed + 2)]
    torch.library.opcheck(ops.gdn_p2p_head_tail_chunk.default, (*tiny, 0.25, CHUNK, group, rank, world))
    return errors


def _packed_model_body(rank: int, world: int, seed: int) -> dict:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from cpcompile.kernels.gdn.triton import prepare

    def make(dtype=torch.float32):
        torch.manual_seed(seed)
        config = Qwen3_5TextConfig(**dict(TEXT, linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=2,
                                          layer_types=["linear_attention", "full_attention"]),
                                   attn_implementation="sdpa")
        return Qwen3_5ForCausalLM(config).to(dtype)

    bounds = torch.tensor((0,) + DOCUMENTS).cumsum(0).tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    ids = torch.randint(0, VOCAB, (1, bounds[-1]), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids, "labels": ids.clone(),
             "position_ids": torch.cat([torch.arange(b - a) for a, b in spans])[None]}
    want = each_document_alone(use_reference_gdn(make()), batch, spans)
    truth = each_document_alone(use_reference_gdn(make(torch.float64)), batch, spans)
    gdn = gdn_wrapper("p2p_head_tail", chunk_size=CHUNK, backend="triton")
    plan = {"accelerator": {"cp_size": world}, "plan_overrides": [
        {"match": "*.linear_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
         "inner_wrapper": gdn},
        {"match": "*.self_attn", "when": "cp", "region_dispatch": False,
         "inner_wrapper": {"_target_": "cpcompile.wrappers.sdpa_hf_load_balance_cp_wrapper"}}]}
    got = cp_outputs(make, batch, plan)
    return {"logits": rel(got["logits"], want["logits"]), "loss": rel(got["loss"], want["loss"]),
            "grads": {n: rel(got["grads"][n], g) for n, g in want["grads"].items()},
            "decay_vs_truth": decay_vs_truth(got["grads"], want["grads"], truth["grads"]),
            "interpreted": type(prepare.gdn_fwd_prepare_kernel).__name__ == "InterpretedFunction"}


def _run_all(rank: int, world: int, seed: int) -> dict:
    return {"op": _op_body(rank, world, seed), "packed model": _packed_model_body(rank, world, seed + 1)}


_results: dict = {}


def results() -> list[dict]:
    if not _results:
        _results["all"] = run_distributed(_run_all, WORLD, random.randrange(1 << 30), timeout=900,
                                          env={"TRITON_INTERPRET": "1"})
    return _results["all"]


def test_head_tail_op_matches_the_whole_sequence():
    """Outputs and every input gradient of both fragments within 1e-4 of the eager core over the
    whole sequence (fp32), on every rank; the op passes `torch.library.opcheck`."""
    for rank, result in enumerate(results()):
        assert max(result["op"].values()) <= 1e-4, (rank, result["op"])


def test_packed_head_tail_model_on_triton_equals_each_document_alone():
    """fp32: logits, loss and gradients within 1e-4 of each document run alone; the decay
    parameters' gradients as close to a float64 run as the fp32 reference is."""
    for result in results():
        r = result["packed model"]
        assert r["interpreted"], r
        rest = [e for n, e in r["grads"].items() if not n.endswith(DECAY_PARAMS)]
        assert max([r["logits"], r["loss"], *rest]) <= 1e-4, r
        assert_decay_as_close_as_reference(r["decay_vs_truth"])
