"""The GDN core's inputs, as the eager backend and the token oracle (``naive``) read them:
shape checks that name the offending tensor, the compute dtype (fp32, or float64 when an input
is), grouped key heads expanded to the value heads, the optional q/k L2 norm, and the head-major
layout ``[B, Hv, T, ...]`` both compute in. Conventions: ``eager``'s docstring.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ...errors import CPInputError
from .common import l2norm

__all__ = [
    "HeadMajor", "check_inputs", "check_starts", "compute_dtype", "expand_key_heads", "head_major", "prepare_qk",
    "starting_state",
]


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64 (reference checks), else fp32 (bf16/fp16 never carry state)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def expand_key_heads(x: Tensor, num_v_heads: int) -> Tensor:
    """``[B, T, Hk, D] -> [B, T, Hv, D]`` so that value head ``h`` sees key head ``h // (Hv // Hk)``."""
    num_k_heads = x.shape[2]
    if num_k_heads == num_v_heads:
        return x
    return x.repeat_interleave(num_v_heads // num_k_heads, dim=2)


def prepare_qk(
    q: Tensor, k: Tensor, use_qk_l2norm_in_kernel: bool, *, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Cast q, k to the compute dtype and optionally L2-normalise them (no head expansion, no scale).

    Normalising after the cast matches transformers, which normalises in fp32 for accuracy.
    """
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q, k


def check_inputs(q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None) -> None:
    """Fail fast, naming the offending tensor, before any shape error surfaces deep in a matmul."""
    if k.dim() != 4 or v.dim() != 4:
        raise CPInputError(f"k and v must be [B, T, H, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    batch, seq_len, num_k_heads, k_dim = k.shape
    num_v_heads, v_dim = v.shape[2], v.shape[3]
    if q is not None and q.shape != k.shape:
        raise CPInputError(f"q must have k's shape {tuple(k.shape)}; got {tuple(q.shape)}")
    if v.shape[:2] != (batch, seq_len):
        raise CPInputError(f"v must be [B={batch}, T={seq_len}, Hv, V]; got {tuple(v.shape)}")
    if num_v_heads % num_k_heads != 0:
        raise CPInputError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (batch, seq_len, num_v_heads):
            raise CPInputError(f"{name} must be [B, T, Hv] = {(batch, seq_len, num_v_heads)}; got {tuple(t.shape)}")
    if state is not None and tuple(state.shape) != (batch, num_v_heads, k_dim, v_dim):
        raise CPInputError(
            f"initial_state must be [B, Hv, K, V] = {(batch, num_v_heads, k_dim, v_dim)}; got {tuple(state.shape)}"
        )


class HeadMajor(NamedTuple):
    """Prepared inputs, head-major ``[B, Hv, T, ...]``, in the compute dtype, q scaled."""

    q: Tensor | None
    k: Tensor
    v: Tensor | None
    g: Tensor
    beta: Tensor


def head_major(
    q: Tensor | None,
    k: Tensor,
    v: Tensor | None,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None,
    use_qk_l2norm_in_kernel: bool,
    dtype: torch.dtype,
) -> HeadMajor:
    # Normalise per key head before expanding to value heads: same result, Hv/Hk times less work.
    num_v_heads = g.shape[2]
    if q is not None:
        q, k = prepare_qk(q, k, use_qk_l2norm_in_kernel, dtype=dtype)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        q = expand_key_heads(q, num_v_heads).transpose(1, 2) * scale
    else:
        k = l2norm(k.to(dtype)) if use_qk_l2norm_in_kernel else k.to(dtype)
    k = expand_key_heads(k, num_v_heads).transpose(1, 2)
    v = None if v is None else v.to(dtype).transpose(1, 2)
    return HeadMajor(q, k, v, g.to(dtype).transpose(1, 2), beta.to(dtype).transpose(1, 2))


def check_starts(starts: Tensor | None, g: Tensor) -> None:
    if starts is not None and (starts.dtype != torch.bool or tuple(starts.shape) != tuple(g.shape[:2])):
        raise CPInputError(f"starts must be a bool [B, T] = {tuple(g.shape[:2])} tensor of document starts; "
                           f"got {starts.dtype} {tuple(starts.shape)}")


def starting_state(state: Tensor | None, like: Tensor, value_dim: int) -> Tensor:
    """The state a computation starts from, in ``like``'s dtype: ``state``, or zeros."""
    batch, heads, _, key_dim = like.shape
    if state is None:
        return like.new_zeros(batch, heads, key_dim, value_dim)
    return state.to(like.dtype)
