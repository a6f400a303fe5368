"""What NCCL asks of the SDPA rewrites, enforced on gloo (issue 13, NCCL-clean).

NCCL refuses a non-contiguous tensor in a collective; gloo copies it silently, and on CPU the
attention kernels hand back contiguous gradients where CUDA's hand back transposed views. So the
suite runs with `CPCOMPILE_STRICT_COLLECTIVES=1` (tests/conftest.py): every rewritten collective
checks in backward that the gradient reaching it is contiguous. Here, on purpose:

1. every SDPA method runs with gradients made
   non-contiguous where CUDA makes them so — the local attention's input gradients and the
   attention modules' output gradients come back transposed — and still equals the CP=1 run;
2. with cpcompile's guard removed (`contiguous_gradient` a plain identity) the strict check
   raises: the check can fail, and would have caught the crash seen on two H200s.
"""
from __future__ import annotations

import random

import pytest
import torch

from cp_harness import HEAD_TAIL_WRAPPER, assert_equivalent, compare_cp_run, hybrid_wrapper, random_batch, sdpa_plan, tiny_qwen3
from dist_utils import DistributedTestError, run_distributed

METHODS = {"all_gather": ("sdpa_hf", 2), "ulysses": ("sdpa_hf_ulysses", 2), "head_tail": (HEAD_TAIL_WRAPPER, 2),
           "hybrid": (hybrid_wrapper(2), 4)}


class _TransposedGradient(torch.autograd.Function):
    """Identity forward; backward returns the same gradient values in a transposed layout."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return transposed_layout(grad)


def transposed_layout(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() >= 2 and x.shape[-1] > 1 else x


def _transposed_outputs(model):
    """Every attention module's output gradient arrives transposed (non-contiguous)."""
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_hook(lambda m, a, out: (_TransposedGradient.apply(out[0]), *out[1:]))
    return model


def _with_transposed_kernel_gradients():
    """The local attention's backward hands back transposed gradients, as CUDA's kernels do."""
    from cpcompile.kernels.attention import op

    op._contiguous_like = lambda grads, inputs: tuple(transposed_layout(g.to(x.dtype)) for g, x in zip(grads, inputs))


def _equivalence(rank: int, world: int, seed: int, method: str) -> dict:
    _with_transposed_kernel_gradients()
    plan = sdpa_plan(world, wrapper=METHODS[method][0])
    return compare_cp_run(lambda: _transposed_outputs(tiny_qwen3(seed)), random_batch(seed, 2, 4 * world, padded=True),
                          plan)


@pytest.mark.parametrize("method", METHODS)
def test_method_is_exact_with_non_contiguous_gradients(method):
    world = METHODS[method][1]
    for result in run_distributed(_equivalence, world, random.randrange(1 << 30), method, timeout=300):
        assert_equivalent(result)


def _without_guard(rank: int, world: int, seed: int) -> None:
    from cpcompile import collectives

    collectives.contiguous_gradient = lambda x: x  # the comm fragments read it at emission
    _equivalence(rank, world, seed, "all_gather")


def test_strict_check_catches_a_non_contiguous_collective_gradient():
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_without_guard, 2, random.randrange(1 << 30), timeout=300)
    text = "\n".join(failure.value.errors.values())
    assert "NonContiguousCollectiveGradient" in text and "all_gather_into_tensor" in text, text
