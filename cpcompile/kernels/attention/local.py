"""`local_attention`: what a CP rank computes after its collectives, the one call the SDPA rewrites emit.

    local_attention(q, k, v, key_tags, chunk_starts, causal, scale, kernel, masked_kernel, query_positions?,
                    unmasked?) -> out

`q [B, Hq, n·c, D]` holds n equal chunks of queries; chunk i sits at global positions
`[chunk_starts[i], chunk_starts[i] + c)` (AllGather: one chunk at r·S_local; Head-Tail: chunks r and
2·cp−1−r; Ulysses: one chunk at 0 spanning the sequence; Hybrid: one chunk spanning its Ulysses
group). Per-document Head-Tail, whose token order depends on the batch, gives the queries' global
positions instead (`query_positions [B, S_q]`, rising along each row; `chunk_starts` is then
unused) and always runs the masked path. `k, v [B, Hkv, S_kv, D]` are in global order;
`key_tags [B, S_kv]` (int64) says which keys are real and to which document each belongs
(`layout.py`). A query at position p sees key j when j is real, of p's document, and, if
`causal`, j ≤ p.

Every rank has the key tags of every rank (a rank without padding of its own still attends to
other ranks' padding and documents). With one unpadded document a row, `chunk_attention` runs the
unmasked blocks on `kernel`; otherwise `masked_kernel` runs — `varlen` (flash's variable-length
kernel over the runs of documents and padding, CUDA half precision), `flex` (FlexAttention, CUDA)
or the tiles of `tiled_attention` on a kernel that takes a mask (the CPU's). Queries at
`query_positions` are not in chunks, which `varlen`'s segments need: `select_kernel` gives them
FlexAttention. `kernel="flex"` (CUDA fp32, which the fused kernels with a log-sum-exp output do not take)
runs FlexAttention always.

Which of the two a call takes is `unmasked`, a fact of the batch that `shard_batch` found on the
global batch (`documents.unmasked_keys`) and that the rewrite bakes into the region's graph, one
graph per value: no read-back from the device, and under `torch.compile` no graph break and the
unmasked kernel. `unmasked=None` (a batch `shard_batch` did not mark) reads it off the tags, one
flag read back from the device; under `torch.compile` it cannot (a graph break at every
attention), so the masked path runs, which is exact without padding too.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...errors import CPConfigError
from ..precision import without_autocast
from .flex import flex_chunk_attention
from .layout import single_unpadded_document
from .op import chunk_attention, tiled_attention, varlen_attention


@without_autocast  # Q/K/V come at the precision autocast gives SDPA; the kernels keep it
def local_attention(q: Tensor, k: Tensor, v: Tensor, key_tags: Tensor, chunk_starts: list[int], causal: bool,
                    scale: float, kernel: str, masked_kernel: str, query_positions: Tensor | None = None,
                    unmasked: bool | None = None) -> Tensor:
    if unmasked is None:
        unmasked = not torch.compiler.is_compiling() and single_unpadded_document(key_tags)
    if query_positions is None and kernel != "flex" and unmasked:
        return chunk_attention(q, k, v, chunk_starts, causal, scale, kernel)[0]
    if masked_kernel == "flex":
        return flex_chunk_attention(q, k, v, key_tags, chunk_starts, causal, scale, query_positions)
    if masked_kernel == "varlen":
        if query_positions is not None:
            raise CPConfigError("attention kernel 'varlen' takes queries in chunks, not at query_positions; use 'flex'")
        return varlen_attention(q, k, v, key_tags, chunk_starts, causal, scale)[0]
    return tiled_attention(q, k, v, key_tags, chunk_starts, causal, scale, masked_kernel, query_positions)[0]


def local_attention_fake(q: Tensor, *args) -> Tensor:
    """Its output's metadata, for graphs that hold a `local_attention` call (no flag is read)."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)
