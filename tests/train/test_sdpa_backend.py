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


def _kernels_on_cuda(backend: str | None) -> Counter:
    """Three steps of the benchmark's small model on CUDA (bf16 compute, eager layers, every layer
    checkpointed), this process its only rank; -> the SDPA kernel ops the third step ran."""
    import argparse
    import os
    import sys

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks"))
    from trainer_gpu import config

    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.loop import build_trainer

    # the eager GDN core: the small model's GDN heads of 16 are below the Triton kernels' GPU minimum
    # of 64, which they refuse (GDNCapabilityError); this test is about the attention layers
    args = argparse.Namespace(cp=1, steps=3, seq_len=2048, small=True, device="cuda", loss_chunk_tokens=4096,
                              compile_backend="eager", gdn_backend="eager", sdpa_backend=backend)
    try:
        trainer = build_trainer(load_train_config(config(args)))
        trainer.step(0)
        trainer.step(1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            trainer.step(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return Counter(e.name.removeprefix("aten::") for e in profile.events() if "_scaled_dot_product_" in e.name)


@pytest.mark.gpu
@pytest.mark.parametrize("chosen, other", [("cudnn", "flash"), ("flash", "cudnn")])
def test_gpu_the_chosen_kernel_runs_the_attention_forward_replay_and_backward(chosen, other):
    """On CUDA, with `sdpa_backend` set, that kernel runs the model's attention, twice a layer
    forward (forward, replay) and once backward, and the other fused kernel never does. Both
    directions: PyTorch 2.11's own pick on an H200 is cuDNN already, so only `flash` changes it
    there."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kernels = _kernels_on_cuda(chosen)
    chosen_op, other_op = (f"_scaled_dot_product_{name}_attention" for name in (chosen, other))
    assert kernels[other_op] == 0 and kernels[other_op + "_backward"] == 0, kernels
    assert kernels[chosen_op] == 2 * kernels[chosen_op + "_backward"] > 0, kernels
