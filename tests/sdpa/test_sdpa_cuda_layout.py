"""The rewritten SDPA regions on one CUDA device, under the fake process group (`-m gpu`).

CUDA's attention kernels hand back gradients in their own layouts (flash and cuDNN: transposed
views), which a CPU run cannot show. One process plays rank 1 of 2 (collectives move no data), runs
every method's forward and backward in bf16 on a Qwen3-shaped model, unpadded (cuDNN blocks) and
padded (FlexAttention), with `CPCOMPILE_STRICT_COLLECTIVES=1`: every gradient that reaches a
collective must be contiguous, as NCCL requires. The numbers are not checked here (the fake group
moves nothing); tests/sdpa/test_sdpa_nccl.py checks them on two GPUs.
"""
from __future__ import annotations

import pytest
import torch

from cp_harness import HEAD_TAIL_WRAPPER, method_wrapper, random_batch, sdpa_plan
from dist_utils import run_distributed

METHODS = {"all_gather": "sdpa_hf", "ulysses": "sdpa_hf_ulysses", "head_tail": HEAD_TAIL_WRAPPER,
           "async_all_gather": method_wrapper("all_gather", True), "async_ulysses": method_wrapper("ulysses", True)}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(_process: int, _processes: int, padded: bool) -> dict:
    import os

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import cpcompile

    os.environ["CPCOMPILE_STRICT_COLLECTIVES"] = "1"
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    kernels = {}
    for method, wrapper in METHODS.items():
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64, attn_implementation="sdpa")
        plan = cpcompile.load_plan(sdpa_plan(2, wrapper=wrapper))
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cuda")
        batch = {k: v.cuda() for k, v in random_batch(0, 2 if padded else 1, 4096, padded=padded).items()}
        local = cpcompile.shard_batch(batch, mesh, plan)
        model = cpcompile.compile(Qwen3ForCausalLM(config).to("cuda", torch.bfloat16), mesh, plan, example_inputs=local)
        model(**local).loss.backward()
        torch.cuda.synchronize()
        kernels[method] = model.model.layers[0].self_attn.forward.__self__.programs and "ran"
    dist.destroy_process_group()
    return kernels


@pytest.mark.parametrize("padded", [False, True])
def test_every_method_hands_collectives_contiguous_gradients_on_cuda(padded):
    (ran,) = run_distributed(_run, 1, padded, init_pg=False, start_method="spawn", timeout=600)
    assert ran == {method: "ran" for method in METHODS}
