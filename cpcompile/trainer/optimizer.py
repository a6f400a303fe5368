"""The optimizer of a training run: AdamW with its LR schedule (linear warmup, then cosine or
constant), and the global gradient norm with its clipping (`train.grad_clip`), per device mesh."""
from __future__ import annotations

import math

import torch

from .config import TrainConfig


def build_optimizer(model: torch.nn.Module, config: TrainConfig):
    """AdamW and its LR schedule: linear warmup over `warmup_steps`, then cosine down to
    `lr * min_lr_ratio` at the last step (or constant)."""
    opt = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr, betas=opt.betas, eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    total, warmup = config.train.steps, opt.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if opt.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
        return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_gradients(grads: list[torch.Tensor], max_norm: float | None) -> float:
    """The global 2-norm of `grads` (before clipping); with `max_norm`, scale them in place as
    `clip_grad_norm_` does (by max_norm / (norm + 1e-6) when that is below 1).

    `clip_grad_norm_` stacks the per-tensor norms, which DTensors of different meshes refuse: with
    TP, FSDP2's gradients of the tensor-parallel linears live on (dp_shard_cp, tp) and the others
    on dp_shard_cp. So the norm is taken per mesh (each a full, reduced value) and combined."""
    by_mesh: dict = {}
    for grad in grads:
        by_mesh.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0
    if max_norm is not None and total + 1e-6 > max_norm:
        for group in by_mesh.values():
            torch._foreach_mul_(group, max_norm / (total + 1e-6))
    return total
