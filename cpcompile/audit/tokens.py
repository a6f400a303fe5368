"""The local token batch the audits watch: `B` rows of `S` local tokens.

The audits must run on every example `compile` accepts (a Hugging Face batch, a dict under other
key names, positional inputs, a bare tensor), so they do not look for an input by its name. The
local sequence is what the attention cores see: the first core the probe forward runs gives `B`
and `S` (an SDPA call's query is `[B, heads, S, D]`, a GDN layer's input `[B, S, hidden]`). The
example's own sequence-carrying tensors are then those with an axis of `S` after the batch axis.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import CPInputError

SLICE_ELEMENTS = 1 << 26  # float32 values a slice of `TokenBatch.per_token` holds (256 MB)


@dataclass(frozen=True)
class TokenBatch:
    """The local batch's shape: `batch` rows of `length` tokens each."""

    batch: int
    length: int

    def axis(self, tensor: torch.Tensor) -> int | None:
        """The token axis of `tensor`: 1 for `[B, S, ...]`, 0 for flattened tokens `[B·S, ...]`; None
        if it has neither layout."""
        if tensor.dim() >= 2 and tensor.shape[0] == self.batch and tensor.shape[1] == self.length:
            return 1
        if tensor.dim() >= 1 and self.length > 1 and tensor.shape[0] == self.batch * self.length:
            return 0
        return None

    def per_token(self, tensor: torch.Tensor, minus: torch.Tensor | None = None) -> torch.Tensor:
        """`[B, S]`: the largest absolute entry of each token of `tensor` (laid out `[B, S, ...]` or
        `[B·S, ...]`: both flatten token by token), or of `tensor - minus`. It runs over slices of
        tokens: a wide output (the logits of a large vocabulary: 18.5 GiB in float32 at 32K tokens)
        is never copied whole."""
        rows = self.batch * self.length
        flat = tensor.detach().reshape(rows, -1)
        other = minus.detach().reshape(rows, -1) if minus is not None else None
        step = max(1, SLICE_ELEMENTS // max(1, flat.shape[1]))
        out = torch.empty(rows, dtype=torch.float32, device=tensor.device)
        for start in range(0, rows, step):
            piece = flat[start:start + step].float()
            if other is not None:
                piece = piece - other[start:start + step].float()
            out[start:start + step] = piece.abs().amax(-1)
        return out.reshape(self.batch, self.length)

    def sequence_axes(self, tensor: torch.Tensor) -> tuple[int, ...]:
        """The axes of an example input that run along the local sequence: every axis after the
        first of size `length` (one for token ids `[B, S]`, two for a mask `[B, 1, S, S]`)."""
        return tuple(d for d in range(1, tensor.dim()) if tensor.shape[d] == self.length)


def from_sdpa_call(query: torch.Tensor) -> TokenBatch:
    return TokenBatch(int(query.shape[0]), int(query.shape[-2]))


def from_layer_input(hidden_states: torch.Tensor) -> TokenBatch:
    return TokenBatch(int(hidden_states.shape[0]), int(hidden_states.shape[1]))


def from_shapes(example: Any, region_call: tuple) -> TokenBatch:
    """The local batch of a model whose regions run no attention core (module docstring)."""
    tensors = [leaf for leaf in pytree.tree_leaves(example) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2]
    inside = {size for leaf in pytree.tree_leaves(region_call) if isinstance(leaf, torch.Tensor)
              for size in leaf.shape[1:]}
    sizes = sorted({size for leaf in tensors for size in leaf.shape[1:]} & inside)
    if not tensors or len(sizes) != 1:
        raise CPInputError(
            "no attention core (SDPA call, GDN layer) ran in the probe forward, and the local sequence length cannot "
            f"be told from the shapes: {'sizes ' + str(sizes) + ' are each' if sizes else 'no size is'} an axis of the "
            "example and of the first region's inputs; compile with an example whose local length differs from its "
            "other sizes (the audits of the code outside the regions need it)")
    return TokenBatch(int(tensors[0].shape[0]), int(sizes[0]))
