"""The oracle beside the attention kernels: explicit-mask attention in float64 (tests only, small S)."""
from __future__ import annotations

import torch
from torch import Tensor


def query_positions(chunk_starts: list[int], rows: int) -> Tensor:
    """Global position of every local query row (equal chunks at `chunk_starts`)."""
    chunk = rows // len(chunk_starts)
    return torch.cat([torch.arange(s, s + chunk) for s in chunk_starts])


def naive_attention(q: Tensor, k: Tensor, v: Tensor, chunk_starts: list[int], *, causal: bool = True,
                    key_valid: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Softmax attention with the visibility the kernels implement; rows that see nothing give 0."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    positions = query_positions(chunk_starts, q.shape[2]).to(q.device)
    visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    if causal:
        visible = torch.arange(k.shape[2], device=q.device) <= positions[:, None]
    visible = visible[None, None] & (key_valid[:, None, None, :] if key_valid is not None else True)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs @ v
