"""Masked local attention on CUDA: FlexAttention with a block mask built from block statistics.

A query sees a key when the key is real, of the query's document and, under causality, not after
it (`layout.py`). On 128 × 128 tiles that gives three kinds: invisible (skipped), fully visible
(run without evaluating the mask) and partial (the mask is evaluated per element). They are
computed from per-key-block statistics (all real? the range of documents of its real keys) and
each query block's position and document ranges: O(S) work plus an (S_q/128) × (S_kv/128) index
table, never an S_q × S_kv mask — `create_block_mask` would evaluate the mask on every element
to find the same blocks. Documents are contiguous and numbered in sequence order, so a block's
documents are a range and two blocks share a document exactly when their ranges overlap.

FlexAttention runs fused only when compiled; `torch.compile(flex_attention)` is made once per
process (eager flex attention falls back to a dense, quadratic path). Its backward has no CPU
implementation, so CPU ranks use the tiled kernel instead (`tiled.py`).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ...collectives import contiguous_gradient
from .layout import documents, query_documents
from .layout import query_positions as query_positions_of

BLOCK = 128


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _blocks_of(x: Tensor, fill, length: int) -> Tensor:
    """`[..., S]` → `[..., ceil(S/BLOCK), BLOCK]`, padded with `fill`."""
    pad = -length % BLOCK
    if pad:
        x = torch.cat([x, x.new_full((*x.shape[:-1], pad), fill)], dim=-1)
    return x.unflatten(-1, (-1, BLOCK))


def _as_indices(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Boolean `[B, 1, nq, nk]` → (count per query block, the kv block indices listed first)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, order


def _ranges(docs: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    """Lowest and highest document among the `real` entries of each block (`[..., n, BLOCK]`);
    a block with none gets an empty range (low > high)."""
    big = torch.iinfo(docs.dtype).max
    low = torch.where(real, docs, big).amin(-1)
    high = torch.where(real, docs, -1).amax(-1)
    return low, high


def block_mask(key_tags: Tensor, chunk_starts: list[int], q_len: int, causal: bool,
               query_positions: Tensor | None = None):
    """The FlexAttention `BlockMask` of queries at `chunk_starts` chunks (or at `query_positions
    [B, S_q]`, rising along each row) against keys `0..S_kv-1`."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, kv_len = key_tags.shape
    device = key_tags.device
    per_row = query_positions is not None  # else one `[S_q]` for every row, from the chunk starts
    if per_row:
        positions = query_positions.long().expand(batch, q_len)
    else:
        positions = query_positions_of(chunk_starts, q_len, device)
    tags = _blocks_of(key_tags, -1, kv_len)                                   # [B, nk, BLOCK], -1: padding
    key_low, key_high = _ranges(documents(tags), tags >= 0)                    # [B, nk]
    all_real = (tags >= 0).all(-1)
    q_pos = _blocks_of(positions, -1, q_len)                                  # [(B,) nq, BLOCK], -1: past the end
    q_docs = _blocks_of(query_documents(key_tags, positions), -1, q_len)      # [B, nq, BLOCK]
    q_low, q_high = _ranges(q_docs, q_pos >= 0)                               # [B, nq]
    first_key = torch.arange(0, tags.shape[1] * BLOCK, BLOCK, device=device)
    if causal:
        lowest = torch.where(q_pos >= 0, q_pos, kv_len).amin(-1)
        whole = (first_key + BLOCK - 1) <= lowest[..., None]                 # [(B,) nq, nk]
        some = first_key <= q_pos.amax(-1)[..., None]
    else:
        whole = some = torch.ones(*q_pos.shape[:-1], first_key.shape[0], dtype=torch.bool, device=device)
    one_document = (key_low == key_high)[:, None, :] & (q_low == q_high)[:, :, None] \
        & (key_low[:, None, :] == q_low[:, :, None])                         # [B, nq, nk]
    overlap = (key_low[:, None, :] <= q_high[:, :, None]) & (q_low[:, :, None] <= key_high[:, None, :])
    full = whole & all_real[:, None, :] & one_document
    partial = some & overlap & ~full
    # padded to whole blocks: the kernel evaluates the mask on a partial block's every element
    flat_tags, flat_pos, flat_docs = tags.flatten(-2), q_pos.flatten(-2), q_docs.flatten(-2)

    def seen(b, h, q_idx, kv_idx):
        same = flat_tags[b, kv_idx] == flat_docs[b, q_idx]
        if not causal:
            return same
        return same & ((flat_pos[b, q_idx] if per_row else flat_pos[q_idx]) >= kv_idx)

    counts, indices = _as_indices(partial[:, None])
    full_counts, full_indices = _as_indices(full[:, None])
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=BLOCK, mask_mod=seen,
                                    seq_lengths=(q_len, kv_len))


def flex_chunk_attention(q: Tensor, k: Tensor, v: Tensor, key_tags: Tensor, chunk_starts: list[int], causal: bool,
                         scale: float, query_positions: Tensor | None = None) -> Tensor:
    """FlexAttention under the block mask; its input gradients come back contiguous, as the custom
    ops' do (K and V come from collectives)."""
    q, k, v = (contiguous_gradient(x) for x in (q, k, v))
    mask = block_mask(key_tags, chunk_starts, q.shape[2], causal, query_positions)
    return compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
