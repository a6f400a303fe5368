"""Nothing quadratic in the sequence (issue 13): no SDPA method makes an S_q × S_kv tensor.

Each method runs one forward and backward of a one-layer Qwen3 with tiny widths at two long
sequences, under the fake process group (shapes as on real ranks, no data moved), while a
dispatch mode records the largest tensor any op produces. A mask or score matrix of local
queries against global keys would quadruple when the sequence doubles; everything CP is allowed
to make (activations, K/V, key validity, FlexAttention's block table) at most doubles. With
padding the model itself builds its local `[B, 1, S_local, S_local]` mask: the bound is that.
The kernels' own internals are held to the same rule in tests/kernels/test_local_attention.py.
"""
from __future__ import annotations

import pytest
import torch

from cp_harness import HEAD_TAIL_WRAPPER, VOCAB, LargestTensor, hybrid_wrapper, method_wrapper, random_batch, sdpa_plan
from dist_utils import run_distributed

WORLD = 4
METHODS = {
    "all_gather": "sdpa_hf", "ulysses": "sdpa_hf_ulysses", "head_tail": HEAD_TAIL_WRAPPER,
    "hybrid": hybrid_wrapper(2), "async_all_gather": method_wrapper("all_gather", True),
    "async_ulysses": method_wrapper("ulysses", True), "async_hybrid": method_wrapper("hybrid", True),
}
LOCAL = (512, 1024)  # local lengths: global 2048 and 4096 tokens


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=2, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config)


def _largest(_process: int, _processes: int, world: int, padded: bool) -> dict:
    """One process plays the last cp rank (AllGather's busiest) of `world`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile

    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    out = {}
    for method, wrapper in METHODS.items():
        for local in LOCAL:
            plan = cpcompile.load_plan(sdpa_plan(world, wrapper=wrapper))
            mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
            batch = cpcompile.shard_batch(random_batch(0, 1, local * world, padded=padded), mesh, plan)
            model = cpcompile.compile(_tiny_qwen3(), mesh, plan, example_inputs=batch)
            with LargestTensor() as mode:
                model(**batch).loss.backward()
            out[method, local] = mode.numel
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("padded", [False, True])
def test_no_method_makes_a_quadratic_tensor(padded):
    (largest,) = run_distributed(_largest, 1, WORLD, padded, init_pg=False, timeout=600)
    for method in METHODS:
        small, large = (largest[method, local] for local in LOCAL)
        quadratic = LOCAL[1] * LOCAL[1] * WORLD  # local queries x global keys, one head
        own_mask = LOCAL[1] * LOCAL[1] if padded else 0  # the model's own local mask (batch 1)
        assert large <= max(2 * small, own_mask), (method, small, large)
        assert large < quadratic // 2, (method, large, quadratic)
