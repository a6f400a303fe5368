"""Inductor's generated CUDA backward keeps the async schedule (issue 19; `-m gpu`, one GPU).

One process plays rank 0 of 4 under the fake process group (collectives move nothing), compiles a
one-layer Qwen3 in bf16 with `torch.compile` (Inductor) for each async method, runs a step and
reads the generated backward code: every launch (`bufN = ..._c10d_functional.<collective>(...)`)
is waited (`wait_tensor(bufN)`), and kernels run between launches and their waits — for AllGather
under both reduce-scatters. Inductor's peak-memory reordering would otherwise put each wait right
after its launch (docs/async.md), and the ordering tool the pass uses must exist in this torch.
"""
from __future__ import annotations

import re

import pytest
import torch

from cp_harness import ASYNC_METHODS, method_wrapper, random_batch, sdpa_plan
from dist_utils import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAUNCH = re.compile(r"(buf\d+) = torch\.ops\._c10d_functional\.(\w+)\.default\(")
WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)")
KERNEL = re.compile(r"\.run\(|extern_kernels\.|torch\.ops\.(aten|cpcompile)\.")


def _backward_codes(_process: int, _processes: int) -> dict:
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import cpcompile

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    codes = {}
    for method in ASYNC_METHODS:
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=64, attn_implementation="sdpa")
        plan = cpcompile.load_plan(sdpa_plan(4, wrapper=method_wrapper(method, True)))
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cuda")
        local = cpcompile.shard_batch({k: v.cuda() for k, v in random_batch(0, 1, 4096, padded=False).items()}, mesh, plan)
        model = cpcompile.compile(Qwen3ForCausalLM(config).to("cuda", torch.bfloat16), mesh, plan, example_inputs=local)
        torch._dynamo.reset()
        _, generated = run_and_get_code(lambda: torch.compile(model)(**local).loss.backward())
        codes[method] = [code for code in generated if "wait_tensor" in code and "tangents" in code]
    dist.destroy_process_group()
    return codes


def windows(code: str) -> list[tuple[str, int]]:
    """(collective, kernels between its launch and its wait) per launch of the code's `call`."""
    lines = code[code.index("def call("):].splitlines()
    launched = {}
    out = []
    for i, line in enumerate(lines):
        if (launch := LAUNCH.search(line)) is not None:
            launched[launch.group(1)] = (launch.group(2), i)
        elif (wait := WAIT.search(line)) is not None and wait.group(1) in launched:
            kind, start = launched.pop(wait.group(1))
            out.append((kind, sum(bool(KERNEL.search(x)) for x in lines[start + 1: i])))
    assert not launched, f"launched and never waited: {launched}"
    return out


_codes: dict = {}


def codes() -> dict:
    if not _codes:
        (result,) = run_distributed(_backward_codes, 1, init_pg=False, start_method="spawn", timeout=600)
        _codes.update(result)
    return _codes


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_inductor_cuda_backward_runs_kernels_under_its_collectives(method):
    (code,) = codes()[method]
    found = windows(code)
    assert found, "no collective in the compiled backward"
    assert any(kernels for _, kernels in found), f"every backward collective is waited at once: {found}"
    if method == "all_gather":
        assert all(kernels for _, kernels in found), f"a reduce-scatter hides no kernel: {found}"
