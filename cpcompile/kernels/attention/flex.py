"""Masked local attention on CUDA: FlexAttention with a block mask built from block statistics.

A query sees key j when the key is real (`key_valid[b, j]`) and, under causality, j ≤ its global
position. On 128 × 128 tiles that gives three kinds: invisible (skipped), fully visible (run
without evaluating the mask) and partial (the mask is evaluated per element). They are computed
from per-key-block "all real" / "any real" flags and each query block's lowest and highest
position: O(S) work plus an (S_q/128) × (S_kv/128) index table, never an S_q × S_kv mask —
`create_block_mask` would evaluate the mask on every element to find the same blocks.

FlexAttention runs fused only when compiled; `torch.compile(flex_attention)` is made once per
process (eager flex attention falls back to a dense, quadratic path). Its backward has no CPU
implementation, so CPU ranks use the tiled kernel instead (`tiled.py`).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ...collectives import contiguous_gradient

BLOCK = 128


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def query_positions(chunk_starts: list[int], rows: int, device) -> Tensor:
    chunk = rows // len(chunk_starts)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in chunk_starts])


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


def block_mask(key_valid: Tensor, chunk_starts: list[int], q_len: int, causal: bool):
    """The FlexAttention `BlockMask` of queries at `chunk_starts` chunks against keys `0..S_kv-1`."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, kv_len = key_valid.shape
    device = key_valid.device
    positions = query_positions(chunk_starts, q_len, device)
    key_blocks = _blocks_of(key_valid, False, kv_len)                        # [B, nk, BLOCK]
    all_real, any_real = key_blocks.all(-1), key_blocks.any(-1)               # [B, nk]
    q_blocks = _blocks_of(positions, -1, q_len)                              # [nq, BLOCK]
    lowest = torch.where(q_blocks >= 0, q_blocks, kv_len).amin(-1)           # padding rows see nothing
    highest = q_blocks.amax(-1)
    first_key = torch.arange(0, all_real.shape[-1] * BLOCK, BLOCK, device=device)
    if causal:
        whole = (first_key + BLOCK - 1)[None, :] <= lowest[:, None]          # [nq, nk]
        some = first_key[None, :] <= highest[:, None]
    else:
        whole = some = torch.ones(len(lowest), len(first_key), dtype=torch.bool, device=device)
    full = whole[None] & all_real[:, None, :]                                # [B, nq, nk]
    partial = some[None] & any_real[:, None, :] & ~full
    # padded to whole blocks: the kernel evaluates the mask on a partial block's every element
    valid, positions = key_blocks.flatten(-2), q_blocks.flatten()

    def visible(b, h, q_idx, kv_idx):
        seen = valid[b, kv_idx]
        return seen & (positions[q_idx] >= kv_idx) if causal else seen

    counts, indices = _as_indices(partial[:, None])
    full_counts, full_indices = _as_indices(full[:, None])
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=BLOCK, mask_mod=visible,
                                    seq_lengths=(q_len, kv_len))


def flex_chunk_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, chunk_starts: list[int], causal: bool,
                         scale: float) -> Tensor:
    """FlexAttention under the block mask; its input gradients come back contiguous, as the custom
    ops' do (K and V come from collectives)."""
    q, k, v = (contiguous_gradient(x) for x in (q, k, v))
    mask = block_mask(key_valid, chunk_starts, q.shape[2], causal)
    return compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
