"""Data under CP in a Hugging Face `Trainer`: every rank of a CP group reads the same batch, and
each target is counted once.

accelerate's `prepare_data_loader` shards batches over every process of the job; under CP only the
dp ranks read different data (world = dp x cp, cp the inner dimension of cpcompile's mesh), so the
sharding wrapper it made is pointed at the dp rank instead (the Trainer itself rewrites the same
two fields for its `BatchRebalanceSampler`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..batch import shard_batch
from ..errors import CPConfigError


def shard_over_dp(loader: Any, dp_size: int, dp_rank: int) -> Any:
    """`loader` (prepared by accelerate) reading the batches of dp rank `dp_rank` of `dp_size`."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

    if isinstance(loader, DataLoaderDispatcher):
        raise CPConfigError(
            "cpcompile.integrations.transformers: accelerate dispatches this iterable dataset's batches from "
            "rank 0 to every process; under CP a cp group shares one batch: set "
            "TrainingArguments(accelerator_config={'dispatch_batches': False})")
    for shard in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)):
        if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
            shard.num_processes, shard.process_index = dp_size, dp_rank
            return loader
    if dist.is_initialized() and dist.get_world_size() > 1:
        # a loader accelerate did not wrap (a streaming `datasets` dataset it sharded itself, say):
        # which rank reads what cannot be told, so it is refused rather than guessed
        raise CPConfigError(
            f"cpcompile.integrations.transformers: cannot point {type(loader).__name__} (dataset "
            f"{type(getattr(loader, 'dataset', None)).__name__}) at dp ranks; use a map-style dataset")
    return loader


def count_targets(batches: list[dict], device: torch.device, cp_size: int, across_dp: bool) -> torch.Tensor | None:
    """The valid next-token targets of `batches` (one gradient-accumulation window), counted as
    `shard_batch` counts them (global shift, -100 at each packed document's last token); with
    `across_dp`, summed over the dp groups (TrainingArguments.average_tokens_across_devices), each cp
    group's shared batches counted once."""
    if not batches or ("labels" not in batches[0] and "shift_labels" not in batches[0]):
        return None
    counts = [shard_batch(_without_count(batch), None, None)["num_items_in_batch"] for batch in batches]
    total = torch.stack([torch.as_tensor(c) for c in counts]).sum().to(device)
    if across_dp and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)  # over dp x cp: every cp rank added the same count
        total = total // cp_size
    return total


def _without_count(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if key != "num_items_in_batch"}
