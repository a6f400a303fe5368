"""Global loss and gradient sync over the `dp_cp` mesh (every valid token counted once).

Contract: each rank produces ``local_loss_sum`` (sum of per-token losses over its own valid
tokens) and ``local_valid_tokens``. The training loss is the global sum over all DP and CP ranks
divided by the global token count; gradients are then SUMMED over ``dp_cp``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _dp_cp_group(mesh: Any):
    """The process group of `mesh.dp_cp`; also accepts a DeviceMesh or a ProcessGroup directly."""
    if mesh is None:
        return None
    target = getattr(mesh, "dp_cp", mesh)
    if hasattr(target, "get_group"):
        return target.get_group()
    return target


def _group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def global_mean_loss(
    local_loss_sum: torch.Tensor, local_valid_tokens: torch.Tensor | int, mesh: Any
) -> torch.Tensor:
    """Mean loss over all valid tokens of all ``dp_cp`` ranks, each token counted once.

    Value (identical on every rank, usable for logging via ``.detach()``):
    ``all_reduce_sum(local_loss_sum) / all_reduce_sum(local_valid_tokens)``.

    Gradient contract: autograd flows only through *this rank's* ``local_loss_sum``, scaled by
    ``1 / global_token_count``; the all-reduced part is detached. Each rank therefore holds
    the gradient of its own share, and **summing** parameter gradients over ``dp_cp`` (SUM, not
    AVG: e.g. `all_reduce_gradients`, or FSDP/DDP configured to sum) gives exactly the gradient
    of the global mean. The token count carries no gradient. With no valid token anywhere the
    loss is 0 (the count is clamped to 1) instead of NaN.
    """
    group = _dp_cp_group(mesh)
    count = torch.as_tensor(local_valid_tokens, device=local_loss_sum.device).detach()
    stats = torch.stack([local_loss_sum.detach().to(torch.float64), count.to(torch.float64)])
    if _group_size(group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    total, n_tokens = stats[0], stats[1].clamp_min(1.0)
    local_share = local_loss_sum / n_tokens.to(local_loss_sum.dtype)
    global_mean = (total / n_tokens).to(local_loss_sum.dtype)
    return local_share + (global_mean - local_share).detach()


def all_reduce_gradients(model: torch.nn.Module, mesh: Any, *, bucket_numel: int = 1 << 24) -> None:
    """SUM every parameter's ``.grad`` over ``mesh.dp_cp`` (plain CP/DP without FSDP or DDP).

    Pairs with `global_mean_loss` (whose gradient is each rank's share). Parameters whose
    ``.grad`` is None are skipped, but all ranks must agree on which those are: one small
    all-reduce checks it first and a RuntimeError names the disagreeing parameters (otherwise
    the bucketed all-reduces would pair up different tensors and silently mix gradients).
    """
    group = _dp_cp_group(mesh)
    world = _group_size(group)
    if world == 1:
        return
    named = list(model.named_parameters())
    device = named[0][1].device if named else torch.device("cpu")
    has_grad = torch.tensor([p.grad is not None for _, p in named], dtype=torch.int32, device=device)
    agree = has_grad.clone()
    dist.all_reduce(agree, op=dist.ReduceOp.SUM, group=group)
    mixed = [name for (name, _), n in zip(named, agree.tolist()) if n not in (0, world)]
    if mixed:
        raise RuntimeError(
            f"all_reduce_gradients: ranks disagree on which parameters have gradients: {mixed[:8]}"
        )
    # a tensor-parallel parameter's gradient is a DTensor: reduce its local shard in place
    grads = [local_tensor(p.grad) for _, p in named if p.grad is not None]
    for bucket in _buckets(grads, bucket_numel):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (sharing its storage), else `t`."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _buckets(grads: list[torch.Tensor], bucket_numel: int):
    """Group gradients of one dtype/device into flat buckets of at most `bucket_numel` elements."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for same_kind in by_kind.values():
        bucket, size = [], 0
        for g in same_kind:
            if bucket and size + g.numel() > bucket_numel:
                yield bucket
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel()
        if bucket:
            yield bucket
