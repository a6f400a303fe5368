"""The serial State-P2P chain steps (pure PyTorch, fp32): all a rank does between receiving and
sending a state or a state gradient."""

from __future__ import annotations

from torch import Tensor
import torch


def chain_step(M: Tensor, S: Tensor, h_in: Tensor | None) -> Tensor:
    """Forward: ``H_out = M @ H_in + S`` (``H_in = None`` means a zero state)."""
    return S.float().clone() if h_in is None else torch.matmul(M.float(), h_in.float()) + S.float()


def chain_grad_step(M: Tensor, dh_local: Tensor, dh_out: Tensor | None) -> Tensor:
    """Backward: ``dH_in = dH_local + M^T @ dH_out`` (``dH_out = None`` means zero)."""
    if dh_out is None:
        return dh_local.float().clone()
    return dh_local.float() + torch.matmul(M.float().transpose(-1, -2), dh_out.float())
