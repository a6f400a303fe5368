"""Attention-mask patterns a CP rewrite understands, and how to rebuild them globally.

Hugging Face hands SDPA either `is_causal=True` with no mask, or a boolean mask built for
the *local* shard: `mask[b, h, i, j] = causal(i, j) and key_valid[b, j]` (or, for
non-causal attention, `key_valid[b, j]` alone). A CP rewrite needs the mask of local
queries against *global* keys, so it keeps only the key-validity row, gathers it, and
re-applies causality with the local block's global offset.
"""
from __future__ import annotations

import torch

from ...errors import UnsupportedMaskError

CAUSAL = "causal"
FULL = "full"


def classify_local_mask(mask: torch.Tensor, fqn: str) -> str:
    """Say whether a real local mask is `causal ∧ key-valid` or `key-valid` alone.

    Anything else (sliding windows, document masks, additive float masks) would be
    silently wrong after the rewrite, so it is refused.
    """
    if mask.dtype != torch.bool:
        raise UnsupportedMaskError(
            f"{fqn}: attention mask has dtype {mask.dtype}; CP rewrites need a boolean SDPA mask "
            "(use attn_implementation='sdpa')"
        )
    if mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        raise UnsupportedMaskError(
            f"{fqn}: attention mask of shape {tuple(mask.shape)} is not a local [B, H, S, S] mask"
        )
    size = mask.shape[-1]
    key_valid = mask[..., -1:, :]  # the last query row sees every key under causality
    causal = torch.ones(size, size, dtype=torch.bool, device=mask.device).tril()
    if torch.equal(mask, causal & key_valid):
        return CAUSAL
    if torch.equal(mask, key_valid.expand_as(mask)):
        return FULL
    raise UnsupportedMaskError(
        f"{fqn}: attention mask is neither causal-with-key-padding nor key-padding only "
        "(sliding-window, packed/document or custom masks are not supported by CP yet)"
    )
