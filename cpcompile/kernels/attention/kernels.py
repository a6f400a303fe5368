"""Fused attention kernels for one block of queries against one block of keys, with log-sum-exp.

Each kernel returns `(out, lse)` for `q [B, Hq, Sq, D]` against `k, v [B, Hkv, Sk, D]` (`lse`
fp32 `[B, Hq, Sq]`) and a backward that takes the *merged* output and log-sum-exp of all the
blocks a query row attends to: a block's exact gradient contribution needs only those two (the
softmax it would have used is exp(scores − lse_merged)). `causal` is only ever asked of square
diagonal blocks, where every convention of `is_causal` agrees.

Which kernel serves a core is fixed when the region is rewritten (`select_kernel`) and shown in
the dump; an unsupported combination raises, it never falls back.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ...errors import CPConfigError

aten = torch.ops.aten


class Kernel(NamedTuple):
    device: str
    dtypes: tuple[torch.dtype, ...]
    grouped_heads: bool  # takes fewer K/V heads than query heads natively
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def no_dropout_rng(device: torch.device) -> tuple[Tensor, Tensor]:
    """Philox seed/offset placeholders: read by the fused backwards only when dropout_p > 0."""
    return torch.empty(2, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.int64, device=device)


def _flash_forward(q, k, v, causal, mask, scale):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(grad_out, q, k, v, out, lse, causal, mask, scale):
    seed, offset = no_dropout_rng(q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)


def _cudnn_forward(q, k, v, causal, mask, scale):
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3])  # cuDNN's statistics carry a trailing unit dim


def _cudnn_backward(grad_out, q, k, v, out, lse, causal, mask, scale):
    seed, offset = no_dropout_rng(q.device)
    stats = lse.unsqueeze(-1).contiguous()
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, stats, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale)


def _cpu_forward(q, k, v, causal, mask, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def _cpu_backward(grad_out, q, k, v, out, lse, causal, mask, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


HALF = (torch.bfloat16, torch.float16)
KERNELS: dict[str, Kernel] = {
    "flash": Kernel("cuda", HALF, True, _flash_forward, _flash_backward),
    "cudnn": Kernel("cuda", HALF, False, _cudnn_forward, _cudnn_backward),
    "cpu_flash": Kernel("cpu", HALF + (torch.float32, torch.float64), True, _cpu_forward, _cpu_backward),
}
MASKED_KERNELS = ("varlen", "flex", "cpu_flash")  # varlen.py, flex.py, or kernels that take a tile mask (tiled.py)
FLEX_DTYPES = HALF + (torch.float32,)
VARLEN_HEAD_DIMS = (129, 256)  # by default: FlexAttention was faster at 128 (H100), flash takes at most 256
KERNEL_ENV = "CPCOMPILE_ATTENTION_KERNEL"
MASKED_KERNEL_ENV = "CPCOMPILE_MASKED_ATTENTION_KERNEL"


def select_kernel(device: torch.device, dtype: torch.dtype, *, masked: bool = False,
                  head_dim: int | None = None, chunked_queries: bool = True) -> str:
    """The kernel for unmasked blocks (`masked=False`) or for padded keys and documents (`masked=True`).

    CUDA: cuDNN for bf16/fp16 blocks (1.5-1.7x flash on an H200, docs/design.md); for masked keys
    flash's variable-length kernel in bf16/fp16 at head sizes 129-256 (at 256 it ran forward and
    backward 1.4-2.1x faster than FlexAttention on an H100, at 128 0.75-0.92x of it:
    benchmarks/results/masked_attention_2026-12-06_NVIDIA-H100.md), FlexAttention otherwise and for
    everything in fp32 (the fused CUDA kernels take half precision only), and for queries at given
    positions (`chunked_queries=False`: per-document Head-Tail), which varlen's segments cannot cut.
    CPU: the fused CPU kernel for both.
    `CPCOMPILE_ATTENTION_KERNEL` / `CPCOMPILE_MASKED_ATTENTION_KERNEL` name others (for
    benchmarks); they must support the device, dtype and head size or the rewrite fails.
    """
    if device.type == "cpu":
        default = "cpu_flash"
    elif device.type == "cuda":
        default = "cudnn" if dtype in HALF and not masked else "flex"
        if masked and dtype in HALF and chunked_queries and head_dim is not None and \
                VARLEN_HEAD_DIMS[0] <= head_dim <= VARLEN_HEAD_DIMS[1]:
            default = "varlen"
    else:
        raise CPConfigError(f"no fused attention kernel for device type {device.type!r} (supported: cuda, cpu)")
    name = os.environ.get(MASKED_KERNEL_ENV if masked else KERNEL_ENV) or default
    check_kernel(name, device, dtype, masked=masked, head_dim=head_dim, chunked_queries=chunked_queries)
    return name


def check_kernel(name: str, device: torch.device, dtype: torch.dtype, *, masked: bool = False,
                 head_dim: int | None = None, chunked_queries: bool = True) -> None:
    if name == "flex":  # FlexAttention serves any mask, so it may stand in for the unmasked blocks too
        if device.type != "cuda" or dtype not in FLEX_DTYPES:
            raise CPConfigError(f"attention kernel 'flex' runs on cuda in {FLEX_DTYPES}, got {device.type} {dtype}")
        return
    if name == "varlen":
        if not masked:
            raise CPConfigError("attention kernel 'varlen' serves masked keys only; unmasked blocks take one of "
                                f"{sorted(KERNELS)}")
        if device.type != "cuda" or dtype not in HALF:
            raise CPConfigError(f"attention kernel 'varlen' runs on cuda in {HALF}, got {device.type} {dtype}")
        if head_dim is not None and head_dim > VARLEN_HEAD_DIMS[1]:
            raise CPConfigError(f"attention kernel 'varlen' takes head sizes up to {VARLEN_HEAD_DIMS[1]}, got "
                                f"{head_dim}; use 'flex'")
        if not chunked_queries:
            raise CPConfigError("attention kernel 'varlen' takes queries in chunks, not at query_positions; use 'flex'")
        return
    kernel = KERNELS.get(name)
    if kernel is None:
        raise CPConfigError(f"unknown attention kernel {name!r}; one of {sorted(KERNELS) + ['flex', 'varlen']}")
    if kernel.device != device.type:
        raise CPConfigError(f"attention kernel {name!r} runs on {kernel.device}, the tensors are on {device.type}")
    if dtype not in kernel.dtypes:
        raise CPConfigError(f"attention kernel {name!r} does not support {dtype} (supports {kernel.dtypes})")
    if masked and name not in MASKED_KERNELS:
        raise CPConfigError(f"attention kernel {name!r} takes no mask; padded attention needs one of {MASKED_KERNELS}")


def lse_dtype(q: Tensor) -> torch.dtype:
    """Log-sum-exp is kept in fp32 (float64 for float64 inputs, as the CPU kernel returns it)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


accumulate_dtype = lse_dtype  # gradients summed over blocks: at least fp32


def repeat_heads(x: Tensor, q_heads: int) -> Tensor:
    """`[B, Hkv, S, D]` → `[B, Hq, S, D]`, query head h reading K/V head h // (Hq / Hkv)."""
    groups = q_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sum_head_groups(grad: Tensor, kv_heads: int) -> Tensor:
    """Inverse of `repeat_heads` for gradients: sum each group of query heads onto its K/V head."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def block_forward(name: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                  mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    kernel = KERNELS[name]
    if not kernel.grouped_heads:
        k, v = repeat_heads(k, q.shape[1]), repeat_heads(v, q.shape[1])
    return kernel.forward(q, k, v, causal, mask, scale)


def block_backward(name: str, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   causal: bool, scale: float, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    kernel = KERNELS[name]
    kv_heads = k.shape[1]
    if not kernel.grouped_heads:
        k, v = repeat_heads(k, q.shape[1]), repeat_heads(v, q.shape[1])
    dq, dk, dv = kernel.backward(grad_out, q, k, v, out, lse, causal, mask, scale)
    return dq, sum_head_groups(dk, kv_heads), sum_head_groups(dv, kv_heads)
