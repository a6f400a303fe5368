"""`train.gdn_checkpoint_around_core`: each GDN layer's ops before its core (projections, conv, q/k
L2 norm, gates) and after it (gated norm, out_proj) under checkpoints of their own, so that a
layer's backward holds only the core's inputs and output of them (the bytes:
tests/train/test_memory_layers.py). The same ops replayed: the layer equals the
plain layer on adversarial inputs, and the trainer's run equals the plain run step by step with
both inner checkpoints running; refused where it saves nothing or is not proven, one test per rule."""
from __future__ import annotations

import random

import pytest
import torch

from dist_utils import run_distributed
from gdn_harness import CHUNK, TEXT, gdn_layer
from test_trainer import _close, _curves, _run, qwen3_5_config, refusal, without_cp


def _layer_run(seed: int, inner: bool, hidden, weight, mask, positions, no_decay: bool) -> list[torch.Tensor]:
    from cpcompile.adapters.qwen3_5 import gdn_layer_forward

    holder = gdn_layer(seed, torch.float64)
    if no_decay:  # A = exp(A_log) ~ 1e-13: every gate ~ 1, the state never forgets
        with torch.no_grad():
            holder.layer.A_log.fill_(-30.0)
    inputs = hidden.clone().requires_grad_()
    out = gdn_layer_forward(holder.layer, inputs, mask, positions, chunk_size=CHUNK, backend="eager",
                            checkpoint_around_core=inner)
    (out * weight).sum().backward()
    return [out, inputs.grad, *(p.grad for p in holder.parameters())]


@pytest.mark.parametrize("case", ["correlated_keys", "documents", "padding", "no_decay_odd_length"])
def test_the_layer_checkpointed_around_its_core_is_the_layer(case):
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    batch, length = 2, 23 if case == "no_decay_odd_length" else 24  # 23: the last chunk of 8 cut short
    hidden = torch.randn(batch, length, TEXT["hidden_size"], dtype=torch.float64)
    mask = positions = None
    if case == "correlated_keys":  # one token repeated with a little noise: nearly collinear keys
        hidden[:, length // 3:] = hidden[:, :1] + 1e-3 * torch.randn_like(hidden[:, length // 3:])
    if case == "documents":  # packed: the conv and the state restart at each document
        positions = torch.cat([torch.arange(n) for n in (5, 11, 8)])[None]
    if case == "padding":
        mask = torch.ones(batch, length, dtype=torch.float64)
        mask[0, -7:] = 0
    weight = torch.randn(batch, length, TEXT["hidden_size"], dtype=torch.float64)
    no_decay = case == "no_decay_odd_length"
    plain = _layer_run(seed, False, hidden, weight, mask, positions, no_decay)
    inner = _layer_run(seed, True, hidden, weight, mask, positions, no_decay)
    assert len(plain) == len(inner) and all(g is not None for g in plain)
    for got, want in zip(inner, plain):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def _plain_and_inner(rank: int, world: int, seed: int) -> dict:
    from cpcompile.adapters import qwen3_5

    calls = []
    checkpoint = qwen3_5.checkpoint

    def counted(function, *args, **kwargs):
        calls.append(function.__name__)
        return checkpoint(function, *args, **kwargs)

    def run(**train) -> list[tuple]:
        config = without_cp(qwen3_5_config(seed, activation_checkpointing="every_layer", **train))
        return _curves(_run(config))

    plain = run()
    qwen3_5.checkpoint = counted
    try:
        inner = run(gdn_checkpoint_around_core=True)
    finally:
        qwen3_5.checkpoint = checkpoint
    return {"plain": plain, "inner": inner, "calls": calls}


def test_the_trainer_checkpointed_around_the_gdn_core_follows_the_plain_run():
    """cp 1, every layer checkpointed, float64: each step's loss, gradient norm and learning rate
    within 1e-12 of the plain run's, and every GDN layer's forward ran both inner checkpoints."""
    (result,) = run_distributed(_plain_and_inner, 1, random.randrange(1 << 30), timeout=300)
    assert _close(result["inner"], result["plain"], 1e-12), (result["inner"], result["plain"])
    gdn_layers = TEXT["num_hidden_layers"] - 1  # gdn_harness.TEXT: 3 GDN layers and an attention layer
    assert result["calls"].count("inputs") == result["calls"].count("output") >= gdn_layers, result["calls"]


def test_it_needs_cpcompiles_gdn_layers():
    config = without_cp(qwen3_5_config(0, gdn_checkpoint_around_core=True))
    config["train"].pop("gdn_backend")
    message = refusal(config)
    assert "train.gdn_checkpoint_around_core" in message and "gdn_backend" in message


def test_it_is_refused_under_cp():
    message = refusal(qwen3_5_config(0, cp=2, gdn_checkpoint_around_core=True))
    assert "train.gdn_checkpoint_around_core" in message and "cp_size=2" in message


def test_it_is_refused_with_selective_checkpointing():
    config = without_cp(qwen3_5_config(0, gdn_checkpoint_around_core=True, activation_checkpointing="selective"))
    message = refusal(config)
    assert "train.gdn_checkpoint_around_core" in message and "selective" in message


def test_it_is_a_boolean():
    message = refusal(without_cp(qwen3_5_config(0, gdn_checkpoint_around_core="yes")))
    assert "train.gdn_checkpoint_around_core" in message


def test_it_is_refused_with_compiled_layers():
    """Compiled, a checkpointed layer's replay is one backward graph in which the inner checkpoints
    run once: their saved tensors would live across the core's backward, saving nothing."""
    message = refusal(without_cp(qwen3_5_config(0, gdn_checkpoint_around_core=True,
                                                 activation_checkpointing="every_layer", compile_backend="aot_eager")))
    assert "train.gdn_checkpoint_around_core" in message and "compile_backend: eager" in message


def _no_gdn_layer(rank: int, world: int) -> str:
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.loop import build_trainer

    config = without_cp(qwen3_5_config(0, gdn_checkpoint_around_core=True))
    config["model"]["layer_types"] = ["full_attention"] * TEXT["num_hidden_layers"]
    try:
        build_trainer(load_train_config(config))
    except PlanError as error:
        return str(error)
    return "built"


def test_it_is_refused_without_a_gdn_layer():
    (message,) = run_distributed(_no_gdn_layer, 1, timeout=300)
    assert "train.gdn_checkpoint_around_core" in message and "no GDN layer" in message, message
