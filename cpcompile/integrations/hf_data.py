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
from ..documents import positions_from_starts, starts_from_cu_seq_lens
from ..errors import CPConfigError, CPInputError

_PREFIX = "cpcompile.integrations.transformers"
# flash attention's varlen arguments, which TRL's padding-free collator (packing=True, or padding_free=True)
# adds beside position_ids; shard_batch refuses them (they describe the whole row, not a rank's slice)
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


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


def without_varlen_keys(batch: dict) -> dict:
    """`batch` with TRL's varlen arguments (`VARLEN_KEYS`) taken out, once checked to describe the same
    documents as its position ids: CP reads the documents from those (shard_batch), and each rank's
    attention is rewritten to keep within them. Without position ids, `cu_seq_lens_q` becomes
    shard_batch's `cu_seq_lens`."""
    if all(batch.get(key) is None for key in VARLEN_KEYS):
        return batch
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None or not torch.equal(torch.as_tensor(cu_q), torch.as_tensor(cu_k)):
        raise CPInputError(f"{_PREFIX}: the batch's cu_seq_lens_q and cu_seq_lens_k differ or one is missing; "
                           "CP reads one set of packed documents (keys: " + ", ".join(sorted(batch)) + ")")
    main = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    starts = starts_from_cu_seq_lens(cu_q, main.shape[0], main.shape[1], f"{_PREFIX}: the batch's 'cu_seq_lens_q'")
    derived = {"position_ids": positions_from_starts(starts).unsqueeze(0), "seq_idx": starts.cumsum(0).sub(1)[None],
               "max_length_q": int(torch.as_tensor(cu_q).diff().max())}
    derived["max_length_k"] = derived["max_length_q"]
    for key, want in derived.items():
        got = batch.get(key)
        if got is not None and not torch.equal(torch.as_tensor(got).long().cpu(), torch.as_tensor(want).long().cpu()):
            raise CPInputError(f"{_PREFIX}: the batch's {key} disagrees with its cu_seq_lens_q; "
                               "CP reads the packed documents from position ids restarting at 0")
    out = {key: value for key, value in batch.items() if key not in VARLEN_KEYS}
    if out.get("position_ids") is None:
        out["cu_seq_lens"] = cu_q
    return out


def count_targets(batches: list[dict], device: torch.device, cp_size: int, across_dp: bool) -> torch.Tensor | None:
    """The valid next-token targets of `batches` (one gradient-accumulation window), counted as
    `shard_batch` counts them (global shift, -100 at each packed document's last token); with
    `across_dp`, summed over the dp groups (TrainingArguments.average_tokens_across_devices), each cp
    group's shared batches counted once."""
    if not batches or ("labels" not in batches[0] and "shift_labels" not in batches[0]):
        return None
    counts = [shard_batch(without_varlen_keys(_without_count(batch)), None, None)["num_items_in_batch"]
              for batch in batches]
    total = torch.stack([torch.as_tensor(c) for c in counts]).sum().to(device)
    if across_dp and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)  # over dp x cp: every cp rank added the same count
        total = total // cp_size
    return total


def _without_count(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if key != "num_items_in_batch"}
