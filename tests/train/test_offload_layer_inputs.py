"""`train.offload_layer_inputs`: the inputs the checkpointed layers keep wait in host memory until
their backward (saved-tensor hooks around each layer's forward that move its hidden-state input
alone). The run equals the plain run step by step (cp 2 with CP regions in the layers; cp 1
compiled, without a graph break); what moves is each layer's input and nothing else, eager and
compiled; refused without checkpointed layers. On CPU the host is the device, so the bytes it saves show on a GPU only
(the estimate: tests/train/test_memory_estimate.py)."""
from __future__ import annotations

import random

import pytest

from dist_utils import run_distributed
from gdn_harness import TEXT, TWO_LAYERS
from test_trainer import _close, _curves, _run, qwen3_5_config, refusal, without_cp


def _plain_and_offloaded(rank: int, world: int, seed: int) -> dict:
    # one GDN and one attention layer (TWO_LAYERS): a region of each kind inside a checkpointed layer
    plain = _curves(_run(qwen3_5_config(seed, activation_checkpointing="every_layer", model=TWO_LAYERS)))
    offloaded = _curves(_run(qwen3_5_config(seed, activation_checkpointing="every_layer", offload_layer_inputs=True,
                                            model=TWO_LAYERS)))
    return {"plain": plain, "offloaded": offloaded}


def test_offloaded_inputs_follow_the_plain_run_under_cp():
    """cp 2 (GDN State-P2P + SDPA AllGather regions inside the checkpointed layers), float64: every
    step's loss, gradient norm and learning rate within 1e-12 of the plain run's on both ranks."""
    for result in run_distributed(_plain_and_offloaded, 2, random.randrange(1 << 30), timeout=300):
        assert _close(result["offloaded"], result["plain"], 1e-12), result


def _recording_hooks(moved: list, hooks):
    """`hooks` (activation_checkpointing._to_host_hooks), recording the shape of each tensor its pack sends to
    the host."""
    from cpcompile.trainer import activation_checkpointing

    def recording(tensor, pin_memory):
        pack, unpack = hooks(tensor, pin_memory)

        def recorded_pack(saved):
            packed = pack(saved)
            if packed is not saved:
                moved.append(tuple(saved.shape))
            return packed
        return recorded_pack, unpack

    activation_checkpointing._to_host_hooks = recording


def _what_is_moved(rank: int, world: int, seed: int) -> dict:
    import torch._dynamo

    from cpcompile.trainer import activation_checkpointing

    hooks = activation_checkpointing._to_host_hooks

    def run(moved: list, **train) -> list[tuple]:
        _recording_hooks(moved, hooks)
        config = without_cp(qwen3_5_config(seed, activation_checkpointing="every_layer", **train))
        config["train"]["steps"] = 2
        return _curves(_run(config))

    plain = run([])
    eager, compiled = [], []
    run(eager, offload_layer_inputs=True)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled_curves = run(compiled, offload_layer_inputs=True, compile_backend="aot_eager")
    return {"eager": eager, "compiled": compiled, "plain": plain, "compiled_curves": compiled_curves,
            "graph_breaks": dict(counters["graph_break"]), "unsupported": sum(counters["unimplemented"].values())}


def test_only_each_layers_input_moves_eager_and_compiled():
    """cp 1, two steps: what goes to the host is each checkpointed layer's hidden-state input
    ([rows, seq_len, hidden]), one a layer a step, and nothing else (no parameter, no rotary table,
    nothing the checkpoint replays), with the layers eager and compiled (aot_eager: its saved
    tensors include the parameters, which stay); compiled, the run equals the plain one (1e-12)
    with no graph break."""
    (result,) = run_distributed(_what_is_moved, 1, random.randrange(1 << 30), timeout=300)
    layer_input = (4, 32, TEXT["hidden_size"])  # test_trainer: batch 4 x seq_len 32
    for moved in (result["eager"], result["compiled"]):
        assert moved == [layer_input] * (2 * TEXT["num_hidden_layers"]), moved
    assert _close(result["compiled_curves"], result["plain"], 1e-12), result
    assert result["graph_breaks"] == {} and result["unsupported"] == 0, result


def _inputs_alive_after_the_forward(rank: int, world: int, seed: int, offload: bool, compile_backend: str) -> list:
    """One step at cp 1 (bf16 compute, as on a GPU); -> for each decoder layer, whether the storage
    of its hidden-state input is still alive when the forward has ended (the loss computed, before
    the backward): a weak reference, taken in a forward pre-hook, that keeps nothing alive itself."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from cpcompile.trainer import load_train_config, loop, step
    from cpcompile.trainer.parallelize import decoder_layers

    config = without_cp(qwen3_5_config(seed, activation_checkpointing="every_layer", offload_layer_inputs=offload,
                                       dtype="float32", compile_backend=compile_backend,
                                       mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"}))
    trainer = loop.build_trainer(load_train_config(config))
    inputs = []
    for layer in decoder_layers(trainer.model):
        layer.register_forward_pre_hook(lambda _, args: inputs.append(StorageWeakRef(args[0].untyped_storage())))
    alive = []
    mean_loss = step.global_mean_loss

    def after_the_forward(*args, **kwargs):
        alive.extend(not weak.expired() for weak in inputs)
        return mean_loss(*args, **kwargs)
    step.global_mean_loss = after_the_forward
    trainer.step(0)
    return alive


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_offloaded_inputs_leave_the_device_after_the_forward(compile_backend):
    """What the switch is for: no layer's input is left on the device between its forward and its
    backward (an earlier version moved a copy to the host and kept the original alive through its
    hooks: the same peak on an H200 as without the switch). Without the switch every input is alive
    there (the checkpoints keep them): the check can fail."""
    seed = random.randrange(1 << 30)
    for offload, expected in ((True, False), (False, True)):
        (alive,) = run_distributed(_inputs_alive_after_the_forward, 1, seed, offload, compile_backend, timeout=300)
        assert alive == [expected] * TEXT["num_hidden_layers"], (offload, alive)


@pytest.mark.parametrize("mode", ["off", "selective"])
def test_it_needs_checkpointed_layers(mode):
    message = refusal(without_cp(qwen3_5_config(0, activation_checkpointing=mode, offload_layer_inputs=True)))
    assert "train.offload_layer_inputs" in message and "every_layer" in message


def test_it_is_a_boolean():
    message = refusal(without_cp(qwen3_5_config(0, activation_checkpointing="every_layer", offload_layer_inputs=1)))
    assert "train.offload_layer_inputs" in message
