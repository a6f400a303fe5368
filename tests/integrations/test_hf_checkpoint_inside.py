"""Compiled layers take the Trainer's gradient checkpointing inside their forwards (`hf_step.
checkpoint_inside`): transformers' own flag goes off, every layer still recomputes its forward in
the backward, and the gradients are those of the model without any checkpoint."""
from __future__ import annotations

import copy

import torch

from cpcompile.integrations.hf_step import checkpoint_inside
from cpcompile.trainer.parallelize import decoder_layers


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).train()


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_trainers_checkpoint_moves_inside_each_layer():
    reference, model = _model(), _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(model)
    assert checkpoint_inside(layers)
    assert not any(layer.gradient_checkpointing for layer in layers)
    calls = []
    for layer in layers:
        layer.self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))  # early in the layer: the
        # recomputation stops once it has what the backward needs (before the MLP finishes)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    got, want = _grads(model, ids), _grads(reference, ids)
    assert len(calls) == 2 * len(layers)  # each layer's forward, and its recomputation in the backward
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_without_the_trainers_checkpoint_nothing_changes():
    model = _model()
    forwards = [layer.forward for layer in decoder_layers(model)]
    assert not checkpoint_inside(decoder_layers(model))
    assert [layer.forward for layer in decoder_layers(model)] == forwards
