"""`trainer/memory.py` (the dry run's estimate) on the 0.57B Qwen3.5-shaped model of
benchmarks/trainer_gpu.py, built on the meta device: its parameter counts from the config are the
model's, and its one H200 measurement so far is met within 10%."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


@pytest.fixture(scope="module")
def model():
    from trainer_gpu import MODEL

    from cpcompile.trainer.parallelize import meta_model

    return meta_model(MODEL)


def _config(cp: int, seq_len: int, loss: str, ac: str = "every_layer", sdpa: str = "sdpa_hf"):
    from trainer_gpu import config

    from cpcompile.trainer import load_train_config

    args = argparse.Namespace(cp=cp, steps=3, seq_len=seq_len, small=False, device="cpu", loss_chunk_tokens=4096,
                              compile_backend=None, gdn_backend=None)
    return load_train_config(config(args, loss, ac, sdpa))


def test_parameters_counted_from_the_config_are_the_models(model):
    from cpcompile.trainer.memory import layer_kinds, layer_parameters, root_parameters

    text = model.config.get_text_config()
    for index, kind in enumerate(layer_kinds(text)):
        assert layer_parameters(text, kind) == sum(p.numel() for p in model.model.layers[index].parameters())
    assert root_parameters(text) + sum(layer_parameters(text, k) for k in layer_kinds(text)) == \
        sum(p.numel() for p in model.parameters())


def test_the_h200_measurement_at_32k_with_the_whole_logits(model):
    """benchmarks/results/trainer_gpu_2026-12-01_NVIDIA-H200.md: cp 1, 32K tokens, `loss: full`,
    every layer checkpointed: peak 63.98 GiB (the loss's float32 buffers over the states)."""
    from cpcompile.trainer.loop import memory_estimate

    params = sum(p.numel() for p in model.parameters())
    estimate = memory_estimate(_config(1, 32768, "full"), params, model.config)
    assert abs(estimate["total"] / 63.98 - 1) < 0.10, estimate


def test_terms_follow_the_mesh_and_the_modes(model):
    from cpcompile.trainer.loop import memory_estimate

    params = sum(p.numel() for p in model.parameters())
    one = memory_estimate(_config(1, 32768, "chunked"), params, model.config)
    two = memory_estimate(_config(2, 65536, "chunked"), params, model.config)  # the same tokens a rank
    assert two["states"] == pytest.approx(one["states"] / 2)
    assert two["total"] < one["total"]
    off = memory_estimate(_config(1, 32768, "chunked", ac="off"), params, model.config)
    assert off["activations"] > 10 * one["activations"] and off["total"] > one["total"]
    full = memory_estimate(_config(1, 32768, "full"), params, model.config)
    assert full["loss"] > 5 * one["loss"]


def test_allgather_keeps_the_other_ranks_keys_and_values(model):
    from cpcompile.trainer.memory import _ElementSizes, layer_saved_bytes

    text, bf16 = model.config.get_text_config(), _ElementSizes(param=4, compute=2, reduce=4)
    local = layer_saved_bytes(text, "full_attention", bf16, 1, "all_gather")
    kv = text.num_key_value_heads * text.head_dim
    for cp in (2, 4, 16):
        assert layer_saved_bytes(text, "full_attention", bf16, cp, "all_gather") - local == 2 * kv * 2 * (cp - 1)
    # Ulysses over 8 ranks with 2 KV heads: each KV head copied 4 times before the exchange
    assert layer_saved_bytes(text, "full_attention", bf16, 8, "ulysses") - local == 2 * kv * 2 * 3


def test_the_checkpointing_modes_order_the_activations(model):
    """Layer by layer as each mode picks them: every layer < every second layer < none; selective
    keeps more than a checkpointed layer's input and less than a layer left alone, and its replay
    (what it recomputes) is smaller than a whole layer's."""
    from cpcompile.trainer.loop import memory_estimate

    params = sum(p.numel() for p in model.parameters())
    every, second, selective, off = (memory_estimate(_config(1, 32768, "chunked", ac=ac), params, model.config)
                                     for ac in ("every_layer", {"every_n": 2}, "selective", "off"))
    assert every["activations"] < second["activations"] < off["activations"]
    assert every["activations"] < selective["activations"] < off["activations"]
    assert selective["layer_backward"] < every["layer_backward"]
    assert off["layer_backward"] < every["layer_backward"]
