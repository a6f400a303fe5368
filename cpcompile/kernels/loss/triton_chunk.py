"""The chunked loss's elementwise work on one chunk of logits, as two Triton kernels: what
`linear_cross_entropy_sum` runs on CUDA when its chunk work is not compiled (eager layers).

- `loss_terms(logits, targets, softcap)` -> (each row's log-sum-exp, the target's logit), float32;
- `logit_gradient_(logits, targets, log_sum_exp, scale, softcap)` -> the logits' buffer holding
  (softmax - one-hot) x the soft-cap's derivative x scale, in the logits' dtype.

Why: eagerly the same work is a chain of ATen passes over a [chunk, vocabulary] float32 copy (cast,
max, subtract, exp, sum; again in the backward, then the one-hot, the scale and the cast back):
about a tenth of the 32K training step on an H200 (benchmarks/results/trainer_profile_2026-12-03_
NVIDIA-H200.md). Each kernel here reads the matmul's logits once in their own dtype and keeps
float32 in registers: one program a row walks the vocabulary in blocks with an online maximum.
The gradient overwrites the logits it reads, so the chunk needs no second [chunk, vocabulary]
buffer. The oracle is `naive.py`; the tests run both under Triton's interpreter on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096  # vocabulary columns a loop step: 16 KiB of float32 a program, 38 steps at 151 936


@triton.jit
def _capped(x, softcap, HAS_CAP: tl.constexpr):
    """`softcap * tanh(x / softcap)` (and the tanh) when HAS_CAP, else x."""
    if HAS_CAP:
        t = 2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0  # tanh, from what every Triton has
        return t * softcap, t
    return x, x


@triton.jit
def loss_terms_kernel(logits, targets, lse, target_logit, V, stride, softcap, HAS_CAP: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        x, _ = _capped(x, softcap, HAS_CAP)
        x = tl.where(cols < V, x, float("-inf"))  # after the cap, which would make -inf finite
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    tl.store(lse + row, running_max + tl.log(running_sum))
    target = tl.load(targets + row)
    chosen, _ = _capped(tl.load(base + target).to(tl.float32), softcap, HAS_CAP)
    tl.store(target_logit + row, chosen)


@triton.jit
def logit_gradient_kernel(logits, targets, lse, scale, V, stride, softcap, HAS_CAP: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    row_lse = tl.load(lse + row)
    target = tl.load(targets + row)
    factor = tl.load(scale).to(tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        x, t = _capped(x, softcap, HAS_CAP)
        grad = tl.exp(x - row_lse) - tl.where(cols == target, 1.0, 0.0)
        if HAS_CAP:
            grad = grad * (1.0 - t * t)
        tl.store(base + cols, (grad * factor).to(logits.dtype.element_ty), mask=inside)


def _check(logits: Tensor, targets: Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or targets.shape != logits.shape[:1]:
        raise ValueError(f"chunk loss kernels: logits [rows, vocab] with unit column stride and targets [rows], got "
                         f"{tuple(logits.shape)} (strides {logits.stride()}) and {tuple(targets.shape)}")


def loss_terms(logits: Tensor, targets: Tensor, softcap: float | None) -> tuple[Tensor, Tensor]:
    """(log-sum-exp, target logit) of each row of `logits [rows, vocab]`, float32 `[rows]`;
    targets must lie in [0, vocab) (the caller has dropped ignored rows)."""
    _check(logits, targets)
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    target_logit = torch.empty_like(lse)
    if rows:
        loss_terms_kernel[(rows,)](logits, targets, lse, target_logit, vocab, logits.stride(0), softcap or 1.0,
                                   HAS_CAP=softcap is not None, BLOCK_V=min(BLOCK, triton.next_power_of_2(vocab)))
    return lse, target_logit


def logit_gradient_(logits: Tensor, targets: Tensor, log_sum_exp: Tensor, scale: Tensor,
                    softcap: float | None) -> Tensor:
    """d(sum of the rows' losses)/d(logits) x `scale` (a one-element tensor: no read-back), written
    over `logits` and returned."""
    _check(logits, targets)
    rows, vocab = logits.shape
    if rows:
        logit_gradient_kernel[(rows,)](logits, targets, log_sum_exp.float().contiguous(), scale, vocab,
                                       logits.stride(0), softcap or 1.0, HAS_CAP=softcap is not None,
                                       BLOCK_V=min(BLOCK, triton.next_power_of_2(vocab)))
    return logits
