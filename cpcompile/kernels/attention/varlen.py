"""Masked local attention on flash's variable-length kernel (CUDA, half precision, head size ≤ 256).

A chunk of queries at global `[start, start + c)` against keys `[0, S_kv)` is cut into segments by
the runs of equal key tags (a document's real tokens, or a stretch of padding; `layout.py`): a
document run's queries see the run's keys up to the chunk's end (causal; flash aligns a short query
segment with the end of its keys, which is where both end) or all of them. Flash's segments must
tile both its query and key tensors in order, so each run gives two: its queries with the keys they
see, then no queries with the run's other keys. A key segment with no queries gets zero gradients;
every query row and every key of the row is in exactly one segment, so nothing is left unwritten,
and nothing `S_q × S_kv` exists.

What differs from the other masked kernels: a padding query's output (and its gradient) is 0 here,
where FlexAttention and the CPU's tiles give it the attention over its document's real keys before
it, as a Hugging Face mask does. No real token reads a padding position's output (real queries see
no padding keys, GDN layers take padded states masked) and the loss ignores it, so the loss and
every gradient are the same; it saves the padding rows' work. A document whose real tokens are
split by padding (an attention mask with holes inside one document) cannot be cut into segments
of contiguous keys: such a batch is refused, naming the other kernel.

The segments are computed on the host from one read of the row's tags (the only host sync, one
per call; the tags are known when the call is made, so the kernel's grid is exact:
`max_q`/`max_k` are the longest segments, not the chunk's bounds, which for many short documents
would launch a block per segment for the longest one). Grouped K/V heads go to the kernel as they
are: flash reads head h // (Hq / Hkv) and sums their gradients itself.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ...errors import CPInputError
from .kernels import lse_dtype, no_dropout_rng
from .layout import chunk_length, chunk_rows

aten = torch.ops.aten


class Segments(NamedTuple):
    """Cumulative query and key offsets of one chunk's segments (int32, on the kernel's device), and
    the longest query and key segment."""
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


def segment_bounds(tags: Tensor, start: int, length: int, causal: bool) -> tuple[Tensor, Tensor]:
    """Query bounds (relative to `start`) and key bounds, `[2 · runs + 1]` each (int64), of a chunk
    of `length` queries at `start` against every key of one row's tags `[S_kv]` (on the host)."""
    change = torch.nonzero(tags[1:] != tags[:-1]).flatten() + 1
    run_start = torch.cat([change.new_zeros(1), change])
    run_end = torch.cat([change, change.new_full((1,), tags.numel())])
    real = tags[run_start] >= 0
    if bool((tags[run_start][real].diff() <= 0).any()):
        raise CPInputError("a document's real tokens are split by padding (an attention mask with zeros inside one "
                           "document): the 'varlen' attention kernel needs each document's keys in one piece; set "
                           "CPCOMPILE_MASKED_ATTENTION_KERNEL=flex")
    end = start + length
    q_low, q_high = run_start.clamp(start, end) - start, run_end.clamp(start, end) - start
    attends = (q_high > q_low) & real  # a document run holding some of the chunk's queries
    seen_end = torch.where(attends, run_end.clamp(max=end) if causal else run_end, run_start)
    # per run: (its queries, the keys they see), then (no queries, its other keys)
    q_bounds = torch.stack([q_high, q_high], 1).flatten()
    k_bounds = torch.stack([seen_end, run_end], 1).flatten()
    return torch.cat([q_low[:1], q_bounds]), torch.cat([run_start[:1], k_bounds])


def segments(tags: Tensor, start: int, length: int, causal: bool, device: torch.device) -> Segments:
    q_bounds, k_bounds = segment_bounds(tags, start, length, causal)
    return Segments(q_bounds.to(device, torch.int32, non_blocking=True),
                    k_bounds.to(device, torch.int32, non_blocking=True),
                    int(q_bounds.diff().max()), int(k_bounds.diff().max()))


def tokens_major(x: Tensor) -> Tensor:
    """`[H, S, D]` → `[S, H, D]`, a view where the last dimension is dense (flash reads any row and
    head strides, but not a strided head dimension)."""
    x = x.transpose(0, 1)
    return x if x.stride(-1) == 1 else x.contiguous()


def flash_forward(q: Tensor, k: Tensor, v: Tensor, seg: Segments, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """`[T, H, D]` tensors → (out `[T_q, Hq, D]`, lse fp32 `[Hq, T_q]`)."""
    out, lse, *_ = aten._flash_attention_forward(q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, causal,
                                                 False, scale=scale)
    return out, lse


def flash_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Segments,
                   causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = no_dropout_rng(q.device)
    return aten._flash_attention_backward(grad_out, q, k, v, out, lse, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k,
                                          0.0, causal, seed, offset, scale=scale)


KERNEL = {"forward": flash_forward, "backward": flash_backward}  # the tests put the oracle's emulation here


def calls(q: Tensor, key_tags: Tensor, chunk_starts: list[int], causal: bool):
    """(batch row, local query rows, segments) of every kernel call: one per row and chunk."""
    c = chunk_length(q, chunk_starts)
    tags = key_tags.cpu()  # the call's one read-back
    for b in range(q.shape[0]):
        for i, start in enumerate(chunk_starts):
            yield b, chunk_rows(i, c), segments(tags[b], start, c, causal, q.device)


def forward(q, k, v, key_tags, chunk_starts, causal, scale) -> tuple[Tensor, Tensor]:
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:3], dtype=lse_dtype(q))
    for b, rows, seg in calls(q, key_tags, chunk_starts, causal):
        o, l = KERNEL["forward"](tokens_major(q[b, :, rows]), tokens_major(k[b]), tokens_major(v[b]), seg, causal,
                                 scale)
        out[b, :, rows] = tokens_major(o)
        lse[b, :, rows] = l
    return out, lse


def backward(grad_out, q, k, v, out, lse, key_tags, chunk_starts, causal, scale) -> tuple[Tensor, Tensor, Tensor]:
    """Each call's key gradients cover every key of its row (zeros where no query sees them), so
    one chunk's are the row's and several chunks' (Head-Tail) add up, in fp32."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    several = len(chunk_starts) > 1
    make = torch.zeros if several else torch.empty  # contiguous: the op's promised layout, no copy after
    dk = make(k.shape, dtype=torch.float32 if several else k.dtype, device=k.device)
    dv = make(v.shape, dtype=torch.float32 if several else v.dtype, device=v.device)
    for b, rows, seg in calls(q, key_tags, chunk_starts, causal):
        dq_c, dk_c, dv_c = KERNEL["backward"](
            tokens_major(grad_out[b, :, rows]), tokens_major(q[b, :, rows]), tokens_major(k[b]), tokens_major(v[b]),
            tokens_major(out[b, :, rows]), lse[b, :, rows].contiguous(), seg, causal, scale)
        dq[b, :, rows] = tokens_major(dq_c)
        if several:
            dk[b] += tokens_major(dk_c)
            dv[b] += tokens_major(dv_c)
        else:
            dk[b], dv[b] = tokens_major(dk_c), tokens_major(dv_c)
    return dq, dk, dv
