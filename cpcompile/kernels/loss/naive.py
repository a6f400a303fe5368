"""The oracle of `triton_chunk.py`: the same two results from whole-tensor float64 ops."""
from __future__ import annotations

import torch
from torch import Tensor


def capped(logits: Tensor, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    logits = logits.double()
    if softcap is None:
        return logits, None
    squashed = torch.tanh(logits / softcap)
    return squashed * softcap, squashed


def naive_loss_terms(logits: Tensor, targets: Tensor, softcap: float | None) -> tuple[Tensor, Tensor]:
    values, _ = capped(logits, softcap)
    return torch.logsumexp(values, dim=1), values.gather(1, targets[:, None].long()).squeeze(1)


def naive_logit_gradient(logits: Tensor, targets: Tensor, scale: float, softcap: float | None) -> Tensor:
    """d(scale x sum of the rows' cross-entropies)/d(logits), float64, by autograd."""
    raw = logits.double().detach().requires_grad_()
    values, _ = capped(raw, softcap)
    loss = torch.nn.functional.cross_entropy(values, targets.long(), reduction="sum") * scale
    return torch.autograd.grad(loss, raw)[0]
