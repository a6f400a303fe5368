"""Llama-4 under CP, and ops inside a region that read the local length (issue 30, items 1, 3, 4).

Before:
- Llama-4's attention temperature tuning (NoPE layers) scaled queries by
  `arange(hidden_states.shape[1])`: local positions on every rank, gradients ~8e-2 off one process;
- chunked attention (`attention_chunk_size`) was not read: wrong by ~1, or, with Head-Tail and a
  padded batch, rank 0 refused its mask while rank 1 waited in a collective (the hang);
- a module reading its call's length (here: scaling by `8 / hidden_states.shape[1]`) ran silently.

Now each region is traced once more with its sequence length symbolic (audit/local_length.py):
`arange(length)` becomes the tokens' global positions (exact under every method), any other read
is refused naming the node and its source line; a chunk shorter than the global sequence is
refused from the configuration, on every rank (a chunk covering it is plain causal attention).
One launch of 2 gloo ranks.
"""
from __future__ import annotations

import random

import pytest
import torch

from cp_harness import (
    HEAD_TAIL_WRAPPER, assert_equivalent, assert_fails_with, compare_cp_run, outcome_of, random_batch, sdpa_plan,
)
from dist_utils import run_distributed
from model_zoo import build

WORLD = 2
LENGTH = 16
METHODS = {"all_gather": "sdpa_hf", "ulysses": "sdpa_hf_ulysses", "head_tail": HEAD_TAIL_WRAPPER}
_results: dict = {}


def tuned_llama4(seed: int, chunk: int | None = None):
    """Layer 1 is a NoPE layer with temperature tuning (floor_scale 4: the scales change every 4
    positions), layer 0 a RoPE layer, chunked when `chunk` is given."""
    return build("llama4", seed, attn_temperature_tuning=True, floor_scale=4, attention_chunk_size=chunk)


def length_scaled_qwen3(seed: int):
    """Layer 1's attention scales its input by 8 / (the call's length): a read of the local length."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    class LengthScaledAttention(Qwen3Attention):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states * (8.0 / hidden_states.shape[1]), *args, **kwargs)

    model = build("qwen3", seed)
    model.model.layers[1].self_attn.__class__ = LengthScaledAttention
    return model


def _dumped(seed: int, world: int) -> dict:
    """The dump's summary of a Llama-4 with temperature tuning and a chunk covering the sequence."""
    import json
    import tempfile

    import cpcompile
    from cpcompile.dump import resolve_dump_dir

    plan = cpcompile.load_plan(sdpa_plan(world))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    with tempfile.TemporaryDirectory() as dump:
        local = cpcompile.shard_batch(random_batch(seed, 1, LENGTH, False), mesh, plan)
        cpcompile.compile(tuned_llama4(seed, chunk=LENGTH), mesh, plan, example_inputs=local, dump_dir=dump)
        with open(resolve_dump_dir(dump) / "summary.json") as summary:  # this rank's folder
            return json.load(summary)


def _run(rank: int, world: int, seed: int) -> dict:
    out = {"dump": _dumped(seed, world)}
    for name, wrapper in METHODS.items():
        batch = random_batch(seed + len(out), 2, LENGTH, padded=True)
        out[f"temperature_{name}"] = compare_cp_run(lambda: tuned_llama4(seed), batch, sdpa_plan(world, wrapper=wrapper))
    out["chunk_covers_sequence"] = compare_cp_run(lambda: tuned_llama4(seed, chunk=LENGTH),
                                                  random_batch(seed + 5, 2, LENGTH, padded=True), sdpa_plan(world))
    out["chunk_head_tail_padded"] = outcome_of(lambda: compare_cp_run(
        lambda: tuned_llama4(seed, chunk=8), random_batch(seed + 6, 2, 2 * LENGTH, padded=True),
        sdpa_plan(world, wrapper=HEAD_TAIL_WRAPPER)))
    out["length_scaled"] = outcome_of(lambda: compare_cp_run(lambda: length_scaled_qwen3(seed),
                                                             random_batch(seed + 7, 1, LENGTH, False), sdpa_plan(world)))
    return out


def results() -> list:
    if not _results:
        _results["all"] = run_distributed(_run, WORLD, random.randrange(1 << 30), timeout=300)
    return _results["all"]


@pytest.mark.parametrize("method", list(METHODS))
def test_temperature_tuning_is_exact(method):
    for result in results():
        assert_equivalent(result[f"temperature_{method}"])


def test_a_chunk_covering_the_sequence_is_exact():
    for result in results():
        assert_equivalent(result["chunk_covers_sequence"])


def test_a_shorter_chunk_is_refused_on_every_rank():
    for rank, result in enumerate(results()):
        assert_fails_with(f"rank {rank}", result["chunk_head_tail_padded"], "UnsupportedMaskError",
                          ["model.layers.0.self_attn", "attention_chunk_size=8", "32 tokens"])


def test_a_read_of_the_local_length_is_refused_naming_node_and_line():
    for rank, result in enumerate(results()):
        assert_fails_with(f"rank {rank}", result["length_scaled"], "UnsupportedError",
                          ["model.layers.1.self_attn", "arithmetic with the local length",
                           "test_llama4_and_local_length.py", "8.0 / hidden_states.shape[1]"])


def test_the_dump_names_each_feature_and_how_it_was_handled():
    """issue 30, item 6: the model's features that need CP rules are read at compile and named in the dump."""
    summary = results()[0]["dump"]
    hazards = {(h["feature"], h["value"], h["where"]): h["handling"] for h in summary["model"]["hazards"]}
    assert "fixed at construction" in hazards["rope_type", "default", "model.rotary_emb"]
    assert "global positions" in hazards["attn_temperature_tuning", "True", "model.layers.1.self_attn"]
    assert "refused when shorter" in hazards["attention_chunk_size", str(LENGTH), "model.layers.0.self_attn"]
    assert "none moved" in hazards["sequence mixers outside the regions", "none found", "<model>"]
    notes = {region["fqn"]: " ".join(region["notes"]) for region in summary["regions"]}
    assert "modeling_llama4.py" in notes["model.layers.1.self_attn"] and "global positions" in notes["model.layers.1.self_attn"]
    assert "global positions" not in notes["model.layers.0.self_attn"]


def test_declared_chunk_is_read_per_layer_from_the_config():
    """Llama-4 chunks its RoPE layers: from `config.layer_types` where the config names them, else
    from the module's `use_rope` (a config without layer types)."""
    from cpcompile.adapters.sdpa import SdpaRegion

    model = tuned_llama4(0, chunk=8)
    declared = [SdpaRegion().declared_attention("attn", layer.self_attn).chunk for layer in model.model.layers]
    assert model.config.layer_types == ["chunked_attention", "full_attention"] and declared == [8, None]
    model.config.layer_types = None
    assert [SdpaRegion().declared_attention("attn", layer.self_attn).chunk for layer in model.model.layers] == [8, None]
    assert SdpaRegion().declared_attention("attn", tuned_llama4(0).model.layers[0].self_attn).chunk is None


class ReadsTheLength(torch.nn.Module):
    """One op of each kind the symbolic trace tells apart, on `hidden_states [B, S, H]`."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, hidden_states):
        if self.kind == "positions":
            return hidden_states * torch.arange(hidden_states.shape[1])[None, :, None]
        if self.kind == "reduction":
            return hidden_states - hidden_states.mean(dim=1, keepdim=True)
        if self.kind == "contraction":
            return hidden_states.transpose(1, 2) @ hidden_states
        if self.kind == "arithmetic":
            return hidden_states / hidden_states.shape[1]
        return hidden_states * torch.ones(hidden_states.shape[:2])[..., None] + hidden_states.mean(-1, keepdim=True)


@pytest.mark.parametrize("kind, what", [
    ("positions", "positions counted along the local length"),
    ("reduction", "a reduction or scan over the local sequence"),
    ("contraction", "a product contracting the local sequence"),
    ("arithmetic", "arithmetic with the local length"),
    ("per_token", None),  # a tensor sized by the length, and a reduction over the hidden size: no read
])
def test_the_symbolic_trace_tells_each_read_of_the_length(kind, what):
    from cpcompile.audit.local_length import find_local_length_reads

    forward = lambda module, *args, **kwargs: type(module).forward(module, *args, **kwargs)
    reads = find_local_length_reads(ReadsTheLength(kind), forward, (torch.randn(2, 6, 6),), {}, 2, 6)
    assert [read.what for read in reads] == ([what] if what else [])
    assert all("test_llama4_and_local_length.py" in read.source for read in reads)
    assert [read.positions for read in reads] == ([True] if kind == "positions" else [False] * len(reads))


def test_length_audit_is_shared_only_by_alike_modules_and_calls():
    """The local-length audit's finding is reused for a module and call alike but for the layer number
    and the length (`installed_region.module_identity`, `length_free_signature`), never across a difference
    that can change what the code reads (Llama-4's `use_rope`, its config, a parameter shape, another batch)."""
    from cpcompile.installed_region import length_free_signature, module_identity
    from cpcompile.region import flatten_call

    class Attention(torch.nn.Module):
        def __init__(self, layer_idx, use_rope, width=8):
            super().__init__()
            self.layer_idx, self.use_rope, self.proj = layer_idx, use_rope, torch.nn.Linear(width, width)

    class Config:
        def __init__(self, tuning):
            self.tuning = tuning

        def to_dict(self):
            return {"tuning": self.tuning}

    assert module_identity(Attention(0, True)) == module_identity(Attention(3, True))
    configured = [Attention(0, True) for _ in range(3)]
    for module, tuning in zip(configured, (True, True, False)):
        module.config = Config(tuning)
    assert module_identity(configured[0]) == module_identity(configured[1]) != module_identity(configured[2])
    assert module_identity(Attention(0, True)) != module_identity(Attention(0, False))
    assert module_identity(Attention(0, True)) != module_identity(Attention(0, True, width=16))

    def key(batch, length):
        return length_free_signature(flatten_call("a", (torch.zeros(batch, length, 8),), {"n": length})[1], length)
    assert key(1, 16) == key(1, 17) and key(1, 16) != key(2, 16)
