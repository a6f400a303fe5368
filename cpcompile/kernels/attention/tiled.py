"""Attention under a mask of padded keys and documents (`layout.py`), in query tiles: each tile of
`TILE` queries attends to the key prefix its last query can see, with an additive tile mask
`[B, 1, tile, prefix]` built on the fly (again in backward, never saved). The largest mask is
`TILE × S_kv`. A query that sees no key gets a zero output, as SDPA gives such a row. Queries at
positions a tensor gives (per-document Head-Tail) read each tile's highest position back to size
its key prefix: one small read per tile, on the CPU this kernel serves.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kernels import accumulate_dtype, block_backward, block_forward, lse_dtype
from .layout import chunk_length, query_documents, visible, visible_keys

TILE = 512  # queries per tile
ALIGN = 16  # mask rows start on 16-element boundaries, as SDPA pads its own masks


def tiles(chunk_starts: list[int], q: Tensor, kv_len: int, causal: bool, query_positions: Tensor | None):
    """(local query rows, their global positions (`[rows]` or `[B, rows]`), visible key count) per tile."""
    if query_positions is not None:
        for offset in range(0, q.shape[2], TILE):
            rows = slice(offset, min(offset + TILE, q.shape[2]))
            positions = query_positions[:, rows]
            yield rows, positions, int(positions.max()) + 1 if causal else kv_len
        return
    chunk = chunk_length(q, chunk_starts)
    for i, start in enumerate(chunk_starts):
        for offset in range(0, chunk, TILE):
            rows = slice(i * chunk + offset, i * chunk + min(offset + TILE, chunk))
            first = start + offset
            positions = torch.arange(first, first + rows.stop - rows.start, device=q.device)
            yield rows, positions, visible_keys(first, rows.stop - rows.start, kv_len, causal)


def tile_mask(key_tags: Tensor, positions: Tensor, keys: int, causal: bool, q: Tensor) -> Tensor:
    """Additive `[B, H, rows, keys]` mask (0 visible, −inf hidden; expanded over heads), its rows
    padded to ALIGN in memory (aligned rows keep fused kernels on their fast path)."""
    rows = positions.shape[-1]
    seen = visible(key_tags, query_documents(key_tags, positions), positions, keys, causal)
    padded = -(-keys // ALIGN) * ALIGN
    mask = torch.full((key_tags.shape[0], 1, rows, padded), float("-inf"), dtype=q.dtype, device=q.device)
    mask[..., :keys].masked_fill_(seen[:, None], 0.0)
    return mask[..., :keys].expand(-1, q.shape[1], -1, -1)


def forward(q, k, v, key_tags, chunk_starts, causal, scale, kernel, query_positions=None) -> tuple[Tensor, Tensor]:
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:3], dtype=lse_dtype(q))
    for rows, positions, keys in tiles(chunk_starts, q, k.shape[2], causal, query_positions):
        mask = tile_mask(key_tags, positions, keys, causal, q)
        out[:, :, rows], lse[:, :, rows] = block_forward(kernel, q[:, :, rows], k[:, :, :keys], v[:, :, :keys],
                                                         False, scale, mask)
    return out, lse


def backward(grad_out, q, k, v, out, lse, key_tags, chunk_starts, causal, scale, kernel, query_positions=None):
    dq = torch.zeros(q.shape, dtype=accumulate_dtype(q), device=q.device)
    dk = torch.zeros(k.shape, dtype=accumulate_dtype(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=accumulate_dtype(v), device=v.device)
    for rows, positions, keys in tiles(chunk_starts, q, k.shape[2], causal, query_positions):
        mask = tile_mask(key_tags, positions, keys, causal, q)
        dq_t, dk_t, dv_t = block_backward(kernel, grad_out[:, :, rows], q[:, :, rows], k[:, :, :keys],
                                          v[:, :, :keys], out[:, :, rows], lse[:, :, rows].contiguous(),
                                          False, scale, mask)
        dq[:, :, rows] += dq_t
        dk[:, :, :keys] += dk_t
        dv[:, :, :keys] += dv_t
    return dq, dk, dv
