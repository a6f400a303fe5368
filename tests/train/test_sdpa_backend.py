"""`train.sdpa_backend`: the one SDPA kernel the model's own attention calls run on (cp 1 here, where
no attention is rewritten). On CPU the choice is between the fused CPU kernel (PyTorch's pick) and
the math path; the kernel that runs is read from the profiler's ops, in the forward, in the
checkpoint replay inside the backward, and in the backward itself, with eager layers and with
compiled ones (aot_eager: the choice is made when the layer is traced). cuDNN, the setting's
purpose on a GPU, is refused on CPU."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from dist_utils import run_distributed
from test_trainer import _close, qwen3_5_config, refusal, without_cp

FUSED_CPU = "_scaled_dot_product_flash_attention_for_cpu"


def _third_step(rank: int, world: int, seed: int, backend: str | None, compile_backend: str) -> dict:
    """Three steps (compiled layers compile at their second call, cpcompile.compiled, and the
    tracing's own calls would count); -> the ops and the record of the third."""
    import torch

    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.loop import build_trainer

    trainer = build_trainer(load_train_config(without_cp(qwen3_5_config(
        seed, activation_checkpointing="every_layer", sdpa_backend=backend, compile_backend=compile_backend))))
    trainer.step(0)
    trainer.step(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        record = trainer.step(2)
    counts = Counter(event.name.removeprefix("aten::") for event in profile.events())
    layers = trainer.model.config.get_text_config().layer_types
    return {"curve": [(3, record["loss"], record["grad_norm"])], "fused": counts[FUSED_CPU],
            "attention_layers": layers.count("full_attention"),
            "fused_backward": counts[FUSED_CPU + "_backward"], "bmm": counts["bmm"]}


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_the_named_kernel_runs_in_the_forward_the_replay_and_the_backward(compile_backend):
    """PyTorch's pick (the fused CPU kernel) runs twice a layer a step (forward and checkpoint
    replay) and its backward once; with `sdpa_backend: math` none of them runs, the math path's
    matmuls do instead, and the step's loss and gradient norm are the same (float64)."""
    seed = random.randrange(1 << 30)
    (default,) = run_distributed(_third_step, 1, seed, None, compile_backend, timeout=300)
    (math,) = run_distributed(_third_step, 1, seed, "math", compile_backend, timeout=300)
    layers = default["attention_layers"]
    assert layers > 0
    assert (default["fused"], default["fused_backward"]) == (2 * layers, layers), default
    assert (math["fused"], math["fused_backward"]) == (0, 0), math
    assert math["bmm"] > default["bmm"], (math, default)
    assert _close(math["curve"], default["curve"], 1e-10), (math, default)


@pytest.mark.parametrize("backend", ["cudnn", "efficient"])
def test_a_cuda_kernel_is_refused_on_cpu(backend):
    message = refusal(without_cp(qwen3_5_config(0, sdpa_backend=backend)))
    assert "train.sdpa_backend" in message and "cpu" in message


def test_an_unknown_backend_is_refused():
    message = refusal(without_cp(qwen3_5_config(0, sdpa_backend="fastest")))
    assert "train.sdpa_backend" in message and "cudnn" in message
