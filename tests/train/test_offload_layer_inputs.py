"""`train.offload_layer_inputs`: the inputs the checkpointed layers keep wait in host memory until
their backward (`torch.autograd.graph.save_on_cpu` around each layer's forward). The run equals the
plain run step by step (cp 2 with CP regions in the layers; cp 1 compiled, without a graph break);
what the hooks move is each layer's input and nothing the checkpoint replays; refused without
checkpointed layers. On CPU the host is the device, so the bytes it saves show on a GPU only
(the estimate: tests/train/test_memory_estimate.py)."""
from __future__ import annotations

import random

import pytest
import torch

from dist_utils import run_distributed
from gdn_harness import TEXT
from test_trainer import _close, _curves, _run, qwen3_5_config, without_cp


def _plain_and_offloaded(rank: int, world: int, seed: int) -> dict:
    plain = _curves(_run(qwen3_5_config(seed, activation_checkpointing="every_layer")))
    offloaded = _curves(_run(qwen3_5_config(seed, activation_checkpointing="every_layer", offload_layer_inputs=True)))
    return {"plain": plain, "offloaded": offloaded}


def test_offloaded_inputs_follow_the_plain_run_under_cp():
    """cp 2 (GDN State-P2P + SDPA AllGather regions inside the checkpointed layers), float64: every
    step's loss, gradient norm and learning rate within 1e-12 of the plain run's on both ranks."""
    for result in run_distributed(_plain_and_offloaded, 2, random.randrange(1 << 30), timeout=300):
        assert _close(result["offloaded"], result["plain"], 1e-12), result


class _RecordingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """PyTorch's save_on_cpu, recording the shape of every tensor it packs."""

    packed: list = []

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
        super().__init__(pin_memory, device_type)
        pack = self.pack_hook

        def recording(tensor):
            _RecordingSaveOnCpu.packed.append(tuple(tensor.shape))
            return pack(tensor)

        self.pack_hook = recording


def _what_is_moved(rank: int, world: int, seed: int) -> dict:
    import torch._dynamo

    torch.autograd.graph.save_on_cpu = _RecordingSaveOnCpu
    config = without_cp(qwen3_5_config(seed, activation_checkpointing="every_layer", offload_layer_inputs=True))
    config["train"]["steps"] = 1
    _run(config)
    moved = list(_RecordingSaveOnCpu.packed)
    plain = _curves(_run(without_cp(qwen3_5_config(seed, activation_checkpointing="every_layer"))))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = _curves(_run(without_cp(qwen3_5_config(seed, activation_checkpointing="every_layer",
                                                      offload_layer_inputs=True, compile_backend="aot_eager"))))
    return {"moved": moved, "plain": plain, "compiled": compiled, "graph_breaks": dict(counters["graph_break"]),
            "unsupported": sum(counters["unimplemented"].values())}


def test_the_hooks_move_each_layers_input_and_compile_without_a_break():
    """cp 1, one step: the tensors save_on_cpu packs are the checkpointed layers' hidden-state inputs
    ([rows, seq_len, hidden], one a layer), nothing of the MLP's or the GDN core's widths that the
    checkpoint replays; with the layers compiled (aot_eager) the run equals the plain one (1e-12)
    with no graph break."""
    (result,) = run_distributed(_what_is_moved, 1, random.randrange(1 << 30), timeout=300)
    hidden_states = [shape for shape in result["moved"] if shape[-1:] == (TEXT["hidden_size"],) and len(shape) == 3]
    assert len(hidden_states) == TEXT["num_hidden_layers"], result["moved"]
    assert not any(TEXT["intermediate_size"] in shape for shape in result["moved"]), result["moved"]
    assert _close(result["compiled"], result["plain"], 1e-12), result
    assert result["graph_breaks"] == {} and result["unsupported"] == 0, result


def _refusal(config: dict) -> str:
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config

    with pytest.raises(PlanError) as caught:
        load_train_config(config)
    return str(caught.value)


@pytest.mark.parametrize("mode", ["off", "selective"])
def test_it_needs_checkpointed_layers(mode):
    message = _refusal(without_cp(qwen3_5_config(0, activation_checkpointing=mode, offload_layer_inputs=True)))
    assert "train.offload_layer_inputs" in message and "every_layer" in message


def test_it_is_a_boolean():
    message = _refusal(without_cp(qwen3_5_config(0, activation_checkpointing="every_layer", offload_layer_inputs=1)))
    assert "train.offload_layer_inputs" in message
