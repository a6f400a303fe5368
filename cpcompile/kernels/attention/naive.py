"""The oracle beside the attention kernels: explicit-mask attention in float64 (tests only, small S)."""
from __future__ import annotations

import torch
from torch import Tensor

from .layout import query_documents, visible
from .layout import query_positions as query_positions_of


def naive_attention(q: Tensor, k: Tensor, v: Tensor, chunk_starts: list[int], *, causal: bool = True,
                    key_tags: Tensor | None = None, scale: float | None = None,
                    query_positions: Tensor | None = None) -> Tensor:
    """Softmax attention with the visibility the kernels implement; rows that see nothing give 0."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    tags = key_tags if key_tags is not None else torch.zeros(k.shape[0], k.shape[2], dtype=torch.long)
    tags = tags.to(q.device)
    positions = (query_positions.to(q.device) if query_positions is not None
                 else query_positions_of(chunk_starts, q.shape[2], q.device))
    seen = visible(tags, query_documents(tags, positions), positions, k.shape[2], causal)[:, None]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs @ v
