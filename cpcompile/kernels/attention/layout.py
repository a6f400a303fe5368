"""Where a rank's queries sit in the global sequence: equal chunks at given global starts."""
from __future__ import annotations

from torch import Tensor


def chunk_length(q: Tensor, chunk_starts: list[int]) -> int:
    """Queries per chunk of `q [B, H, n·c, D]` split into `len(chunk_starts)` equal chunks."""
    rows = q.shape[2]
    if not chunk_starts or rows % len(chunk_starts):
        raise ValueError(f"{rows} queries do not split into {len(chunk_starts)} equal chunks")
    return rows // len(chunk_starts)


def chunk_rows(index: int, length: int) -> slice:
    return slice(index * length, (index + 1) * length)


def visible_keys(start: int, length: int, kv_len: int, causal: bool) -> int:
    """Keys a chunk at global `start` can see: a prefix up to its own end under causality."""
    return min(start + length, kv_len) if causal else kv_len
