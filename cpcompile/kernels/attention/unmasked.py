"""Attention without a mask: per query chunk, the fully visible keys before it (one unmasked call)
and, under causality, its own diagonal block (one `is_causal` call on a square), merged by
log-sum-exp. Keys past a chunk's end are never touched, so causality costs no mask at all.

A non-causal chunk is one unmasked call over every key.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .kernels import accumulate_dtype, block_backward, block_forward, lse_dtype
from .layout import chunk_length, chunk_rows


class Block(NamedTuple):
    """Keys `[start, end)` one query chunk attends to; `causal` for its diagonal block."""

    start: int
    end: int
    causal: bool


def chunk_blocks(start: int, length: int, kv_len: int, causal: bool) -> list[Block]:
    if not causal:
        return [Block(0, kv_len, False)]
    prefix = [Block(0, start, False)] if start > 0 else []
    return prefix + [Block(start, start + length, True)]


def merge_blocks(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Softmax over the union of the blocks' keys from each block's own: weight each block output
    by exp(lse_block − lse_all), in the log-sum-exp dtype (fp32, or float64)."""
    if len(outs) == 1:
        return outs[0], lses[0]
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(o.to(lse.dtype) * torch.exp(l - lse).unsqueeze(-1) for o, l in zip(outs, lses))
    return out, lse


def one_block(q, k, chunk_starts, causal) -> Block | None:
    """The only block when there is one and it reads every key (one chunk from key 0 over as many
    keys: no CP, the unsplit local case), else None. Such a block's kernel results are the op's
    results, with nothing to merge, sum or pad."""
    if len(chunk_starts) != 1:
        return None
    blocks = chunk_blocks(chunk_starts[0], chunk_length(q, chunk_starts), k.shape[2], causal)
    whole = len(blocks) == 1 and (blocks[0].start, blocks[0].end) == (0, k.shape[2])
    return blocks[0] if whole else None


def forward(q, k, v, chunk_starts, causal, scale, kernel) -> tuple[Tensor, Tensor]:
    c = chunk_length(q, chunk_starts)
    only = one_block(q, k, chunk_starts, causal)
    if only is not None:  # the kernel's output as it is (a copy only where its layout is not the promised one)
        out, lse = block_forward(kernel, q, k, v, only.causal, scale)
        return out.contiguous(), lse.to(lse_dtype(q)).contiguous()
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:3], dtype=lse_dtype(q))
    for i, start in enumerate(chunk_starts):
        rows = chunk_rows(i, c)
        parts = [block_forward(kernel, q[:, :, rows], k[:, :, b.start:b.end], v[:, :, b.start:b.end], b.causal, scale)
                 for b in chunk_blocks(start, c, k.shape[2], causal)]
        out[:, :, rows], lse[:, :, rows] = merge_blocks([o for o, _ in parts], [l.to(lse.dtype) for _, l in parts])
    return out, lse


def overlapping(blocks: list[Block]) -> bool:
    """Whether any key is attended by two blocks (its gradient then sums two contributions)."""
    spans = sorted((b.start, b.end) for b in blocks)
    return any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))


def backward(grad_out, q, k, v, out, lse, chunk_starts, causal, scale, kernel) -> tuple[Tensor, Tensor, Tensor]:
    """Each block's fused backward against the merged output and log-sum-exp. A query row sums its
    blocks' dq in fp32; keys shared by two chunks' blocks (Head-Tail's prefixes) sum in fp32 too,
    otherwise each key's gradient is written once, in the input dtype."""
    c = chunk_length(q, chunk_starts)
    only = one_block(q, k, chunk_starts, causal)
    if only is not None:  # no sums: the kernel's gradients, not accumulated into zeroed fp32 buffers and cast back
        return block_backward(kernel, grad_out, q, k, v, out, lse.contiguous(), only.causal, scale)
    plan = [(chunk_rows(i, c), chunk_blocks(start, c, k.shape[2], causal)) for i, start in enumerate(chunk_starts)]
    shared = overlapping([b for _, blocks in plan for b in blocks])
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=accumulate_dtype(k) if shared else k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=accumulate_dtype(v) if shared else v.dtype, device=v.device)
    for rows, blocks in plan:
        row_lse = lse[:, :, rows].contiguous()
        dq_rows = None
        for b in blocks:
            keys = slice(b.start, b.end)
            dq_b, dk_b, dv_b = block_backward(kernel, grad_out[:, :, rows], q[:, :, rows], k[:, :, keys],
                                              v[:, :, keys], out[:, :, rows], row_lse, b.causal, scale)
            dq_rows = dq_b.to(accumulate_dtype(q)) if dq_rows is None else dq_rows + dq_b
            dk[:, :, keys] += dk_b
            dv[:, :, keys] += dv_b
        dq[:, :, rows] = dq_rows
    return dq, dk, dv
