"""`train.activation_checkpointing` (cpcompile/trainer/activation_checkpointing.py) in real gloo runs at cp 2,
float64: a tiny Qwen3.5 (GDN State-P2P + SDPA AllGather, eager GDN core, FSDP2 over the 2 ranks)
trains the same losses and gradient norms under every_layer, {every_n: 2} and selective as
without checkpointing; the layers replayed in the backward are the ones each mode picks; the
selective replay recomputes the cheap ops and none of the saved ones (matmuls, cores,
collectives); a region tracing a new signature inside a selective checkpoint keeps the gradients.
The config's refusals, one test per rule.

One forked job runs every trainer (processes are the cost here)."""
from __future__ import annotations

import collections
import contextlib
import random

import pytest

from cp_harness import random_batch, sdpa_plan
from dist_utils import run_distributed
from gdn_harness import TEXT, gdn_plan

STEPS = 2
MODES = {"off": "off", "every_layer": "every_layer", "every_n_2": {"every_n": 2}, "selective": "selective"}
# ops the selective policy saves, as the recompute would run them (launches, waits and cores)
SAVED = ("aten.mm.", "aten.addmm.", "aten.bmm.", "cpcompile.gdn_chunk.", "cpcompile.gdn_summary.",
         "cpcompile.chunk_attention.", "cpcompile.tiled_attention.", "all_gather_into_tensor", "all_to_all_single",
         "wait_tensor")


def _config(seed: int, ac) -> dict:
    return {"model": {"model_type": "qwen3_5_text", **TEXT}, **gdn_plan(2, "p2p", sdpa="sdpa_hf"),
            "train": {"steps": STEPS, "seq_len": 32, "batch_size": 2, "lr": 1e-3, "seed": seed, "dtype": "float64",
                      "gdn_backend": "eager", "activation_checkpointing": ac}}


def _logging_recomputes(ops: collections.Counter):
    """Make every selective checkpoint count the ops its recompute runs (those it did not save):
    a dispatch mode under the checkpoint's own, which answers the saved ones itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cpcompile.trainer import activation_checkpointing

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    policy_contexts = activation_checkpointing.selective_contexts

    def contexts():
        forward, recompute = policy_contexts()

        @contextlib.contextmanager
        def counted_recompute():
            with Count(), recompute:
                yield
        return forward, counted_recompute()

    activation_checkpointing.selective_contexts = contexts


def _replays(model) -> collections.Counter:
    """Counts, per decoder layer index, the calls of its MLP inside the backward (a replay). A
    pre-hook: the recompute stops early, once it has what the backward needs, before the MLP
    returns."""
    import torch

    from cpcompile.trainer.parallelize import decoder_layers

    counts = collections.Counter()
    for index, layer in enumerate(decoder_layers(model)):
        layer.mlp.register_forward_pre_hook(
            lambda *_, index=index: counts.update([index]) if torch._C._current_graph_task_id() != -1 else None)
    return counts


def _train_each_mode(seed: int) -> dict:
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.loop import build_trainer

    recomputed = collections.Counter()
    _logging_recomputes(recomputed)
    out = {}
    for name, ac in MODES.items():
        trainer = build_trainer(load_train_config(_config(seed, ac)))
        replays = _replays(trainer.model)
        records = [trainer.step(index) for index in range(STEPS)]
        out[name] = {"curve": [(r["loss"], r["grad_norm"]) for r in records], "replays": dict(replays)}
    out["selective"]["recomputed"] = dict(recomputed)
    return out


def _new_signature_inside_selective(rank: int, world: int, seed: int) -> float:
    """The largest gradient difference between a selective-checkpointed forward/backward of a
    compiled CP model (SDPA AllGather, padded) and one without checkpointing, on a length its
    regions first meet inside the checkpointed forward (so they trace it there)."""
    import cpcompile
    from cp_harness import qwen3_with_heads
    from cpcompile.trainer.activation_checkpointing import ACMode
    from cpcompile.trainer.parallelize import apply_activation_checkpointing

    plan = cpcompile.load_plan(sdpa_plan(world))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    model = qwen3_with_heads(seed, 4, 2, layers=2).double()
    cpcompile.compile(model, mesh, plan, example_inputs=cpcompile.shard_batch(random_batch(seed, 2, 8 * world, True),
                                                                              mesh, plan))
    batch = cpcompile.shard_batch(random_batch(seed + 1, 2, 16 * world, padded=True), mesh, plan)
    apply_activation_checkpointing(model, ACMode("selective"))
    model(**batch).loss.backward()
    selective = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for layer in model.model.layers:
        del layer.forward  # the layer's own forward again: no checkpoint
    model(**batch).loss.backward()
    return max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), selective))


def _job(rank: int, world: int, seed: int) -> dict:
    return {"modes": _train_each_mode(seed), "new_signature": _new_signature_inside_selective(rank, world, seed)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_job, 2, random.randrange(1 << 30), timeout=300)


@pytest.mark.parametrize("mode", ["every_layer", "every_n_2", "selective"])
def test_each_mode_trains_as_without_checkpointing_at_cp_2(runs, mode):
    """Every step's loss and gradient norm within 1e-12 of `off` (the replay recomputes the same
    float64 ops, the selective one reads back the saved outputs), on both ranks."""
    for rank in runs:
        got, want = rank["modes"][mode]["curve"], rank["modes"]["off"]["curve"]
        assert len(got) == STEPS and all(abs(g - w) <= 1e-12 * abs(w) for step in zip(got, want)
                                         for g, w in zip(*step)), (mode, got, want)


def test_each_mode_replays_the_layers_it_picks(runs):
    """Of the 4 layers, every_layer and selective replay all in each step's backward, every_n: 2
    layers 2 and 4 (indices 1 and 3), off none."""
    want = {"off": {}, "every_layer": dict.fromkeys(range(4), STEPS), "every_n_2": {1: STEPS, 3: STEPS},
            "selective": dict.fromkeys(range(4), STEPS)}
    for rank in runs:
        assert {name: mode["replays"] for name, mode in rank["modes"].items()} == want


def test_selective_recomputes_the_cheap_ops_and_none_it_saves(runs):
    """The selective replays ran norms and activations again (rsqrt, silu, the GDN conv) but no
    matmul, no GDN or attention core and no collective: those came from the forward's saves, so
    the backward communicates nothing more than without checkpointing."""
    for rank in runs:
        recomputed = rank["modes"]["selective"]["recomputed"]
        for cheap in ("aten.rsqrt.default", "aten.silu.default", "aten.convolution.default"):
            assert recomputed.get(cheap, 0) > 0, (cheap, recomputed)
        assert not [op for op in recomputed if any(saved in op for saved in SAVED)], recomputed


def test_selective_keeps_the_gradients_when_a_region_traces_inside_the_checkpoint(runs):
    for rank in runs:
        assert rank["new_signature"] <= 1e-12, rank["new_signature"]


# --------------------------------------------------------------------------- config refusals


def _load(ac, layers: int = 4):
    from cpcompile.trainer import load_train_config

    config = _config(0, ac)
    config["model"]["num_hidden_layers"] = layers
    config["model"]["layer_types"] = ["linear_attention"] * (layers - 1) + ["full_attention"]
    return load_train_config(config)


@pytest.mark.parametrize("ac, field, words", [
    ("sometimes", "train.activation_checkpointing", "must be off, every_layer, selective or {every_n: k}"),
    ({"every_n": 2, "offset": 1}, "train.activation_checkpointing", "{every_n: k} alone"),
    ({"every_n": 0}, "train.activation_checkpointing.every_n", "integer >= 1"),
    ({"every_n": -2}, "train.activation_checkpointing.every_n", "integer >= 1"),
    ({"every_n": 2.0}, "train.activation_checkpointing.every_n", "integer >= 1"),
    ({"every_n": True}, "train.activation_checkpointing.every_n", "integer >= 1"),
    ({"every_n": 5}, "train.activation_checkpointing.every_n", "the model has 4 decoder layers"),
], ids=["unknown mode", "other key", "zero", "negative", "not an integer", "bool", "more than the layers"])
def test_a_bad_setting_is_refused_naming_the_field(ac, field, words):
    from cpcompile.errors import PlanError

    with pytest.raises(PlanError) as error:
        _load(ac)
    assert str(error.value).startswith(f"{field}:") and words in str(error.value), str(error.value)


def test_yaml_spells_the_modes(tmp_path):
    """A bare `off` (YAML 1.1's False), the mapping `{every_n: 2}` and `every_n: 1` (every_layer)."""
    from cpcompile.yaml_input import read_yaml
    from cpcompile.trainer.activation_checkpointing import ACMode, parse_ac_mode

    path = tmp_path / "ac.yaml"
    path.write_text("a: off\nb: {every_n: 2}\nc:\n  every_n: 1\nd: selective\n")
    modes = {key: parse_ac_mode(value) for key, value in read_yaml(str(path)).items()}
    assert modes == {"a": ACMode("off"), "b": ACMode("every_n", 2), "c": ACMode("every_layer"),
                     "d": ACMode("selective")}
    assert ACMode("every_n", 3).layers(7) == [2, 5]
