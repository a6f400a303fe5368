"""Public CP primitives for a `local_compute_fn` (or any code running on one CP rank).

Each takes `cp`, the `CPMesh` (or anything with `cp_size`, `cp_rank`, `cp_group_name`), works
eagerly and under tracing — its collectives are functional-collective ops, so a traced
`local_compute_fn` shows them in the dump, and the async schedule can move them — and has
autograd:

- `all_gather_sequence(x, cp, seq_dim)`: every rank's block along `seq_dim`, in rank order
  (K/V for attention); backward: reduce-scatter of the gradient.
- `sequence_to_heads(x, cp)` / `heads_to_sequence(x, cp)`: Ulysses' all-to-all, `[B, H, S/cp, D]`
  ↔ `[B, H/cp, S, D]`; backward: the inverse exchange.
- `query_offset(local_len, cp)` and `global_positions(local_len, cp)`: where this rank's tokens
  sit in the global sequence (contiguous layout: rank r holds tokens r·S/cp ...), for a causal
  mask against gathered keys.
- `gather_key_padding(mask, cp)`: a `[B, S/cp]` key-padding mask (True/1 = real token) of every
  rank, `[B, S]`, for masking gathered keys.
- `global_mean_loss(local_loss_sum, local_tokens, mesh)`: the loss over all dp×cp ranks
  (`cpcompile.loss`).
"""
from __future__ import annotations

import torch

from . import collectives as C
from .errors import CPInputError
from .loss import global_mean_loss

__all__ = ["all_gather_sequence", "gather_key_padding", "global_mean_loss", "global_positions", "heads_to_sequence",
           "query_offset", "sequence_to_heads"]


def _group(cp) -> tuple[int, str]:
    return cp.cp_size, cp.cp_group_name


def _waited(launch: torch.Tensor) -> torch.Tensor:
    return C.contiguous_gradient(C.WAIT(launch))


def all_gather_sequence(x: torch.Tensor, cp, seq_dim: int) -> torch.Tensor:
    """`x` of every cp rank concatenated along `seq_dim`, rank 0's block first."""
    size, group = _group(cp)
    seq_dim = seq_dim % x.dim()
    front = x.movedim(seq_dim, 0).contiguous()  # all-gather concatenates along dim 0, in rank order
    return _waited(C.ALL_GATHER(front, size, group)).movedim(0, seq_dim)


def sequence_to_heads(x: torch.Tensor, cp) -> torch.Tensor:
    """Ulysses: `[B, H, S/cp, D]` (this rank's tokens, every head) → `[B, H/cp, S, D]` (every
    token, this rank's heads: rank r gets heads r·H/cp ...). H must divide by cp."""
    size, group = _group(cp)
    batch, heads, length, dim = x.shape
    if heads % size:
        raise CPInputError(f"sequence_to_heads: {heads} heads do not split over cp_size={size}")
    parts = x.reshape(batch, size, heads // size, length, dim).movedim(1, 0).contiguous()
    received = _waited(C.ALL_TO_ALL(parts, [1] * size, [1] * size, group))  # [sender, B, H/cp, S/cp, D]
    return received.movedim(0, 2).reshape(batch, heads // size, size * length, dim)


def heads_to_sequence(x: torch.Tensor, cp) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: `[B, H/cp, S, D]` → `[B, H, S/cp, D]`."""
    size, group = _group(cp)
    batch, heads, length, dim = x.shape
    if length % size:
        raise CPInputError(f"heads_to_sequence: {length} tokens do not split over cp_size={size}")
    parts = x.reshape(batch, heads, size, length // size, dim).movedim(2, 0).contiguous()
    received = _waited(C.ALL_TO_ALL(parts, [1] * size, [1] * size, group))  # [sender, B, H/cp, S/cp, D]
    return received.movedim(0, 1).reshape(batch, size * heads, length // size, dim)


def query_offset(local_len: int, cp) -> int:
    """Global position of this rank's first token (contiguous layout)."""
    return cp.cp_rank * local_len


def global_positions(local_len: int, cp, device=None) -> torch.Tensor:
    """Global positions of this rank's tokens, `[local_len]` (contiguous layout)."""
    return torch.arange(local_len, device=device) + query_offset(local_len, cp)


def gather_key_padding(mask: torch.Tensor, cp) -> torch.Tensor:
    """Every rank's `[B, S/cp]` key-padding mask, joined in global order: `[B, S]` (no gradient)."""
    size, group = _group(cp)
    return C.WAIT(torch.ops._c10d_functional.all_gather_into_tensor(mask.t().contiguous(), size, group)).t()
