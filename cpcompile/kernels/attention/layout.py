"""Where a rank's queries sit in the global sequence, and which keys each may see.

Queries come in equal chunks at given global starts, or (per-document Head-Tail, whose token order
depends on the batch's documents) at the global positions a `[B, S_q]` tensor gives, rising along
each row. Keys are in global order and carry a tag
(`key_tags [B, S_kv]`, int64): the id of the document the key belongs to when it is a real token,
`−(id + 1)` when it is padding. An unpacked batch has one document, id 0, so its tags are 0 for
real keys and −1 for padding. A query sees a key when the key is real, of the query's own
document, and (if causal) not after it.
"""
from __future__ import annotations

import torch
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


def query_positions(chunk_starts: list[int], rows: int, device) -> Tensor:
    """Global position of every local query row."""
    chunk = rows // len(chunk_starts)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in chunk_starts])


def documents(key_tags: Tensor) -> Tensor:
    """The document id of every key, real or padding."""
    return torch.where(key_tags >= 0, key_tags, -key_tags - 1)


def query_documents(key_tags: Tensor, positions: Tensor) -> Tensor:
    """`[B, S_q]`: the document of each query (a query is the token at its position); `positions`
    `[S_q]` (the same for every row) or `[B, S_q]`."""
    docs = documents(key_tags)
    return docs.gather(1, positions.expand(docs.shape[0], -1))


def visible(key_tags: Tensor, query_docs: Tensor, query_pos: Tensor, keys: int, causal: bool) -> Tensor:
    """`[B, S_q, keys]` bool: which of the first `keys` keys each query (at `query_pos`, `[S_q]`
    or `[B, S_q]`) sees."""
    seen = key_tags[:, None, :keys] == query_docs[:, :, None]  # padding tags are negative: never equal
    if causal:
        seen = seen & (torch.arange(keys, device=key_tags.device) <= query_pos[..., :, None])
    return seen


def single_unpadded_document(key_tags: Tensor) -> bool:
    """True when no key is padded and all belong to one document (reads one flag off the device)."""
    return not bool(key_tags.ne(0).any())
