"""What the Hugging Face `Trainer` integration refuses, each with one line naming the cause.

Checked once, when `context_parallel` wraps the trainer (before any step runs), except the packed
batch without positions, which only a batch can show (`refuse_packing_without_positions`).
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import CPConfigError, CPInputError
from ..plan import Plan

_PREFIX = "cpcompile.integrations.transformers"


def refuse_unsupported_trainer(trainer: Any, plan: Plan, world_size: int, fsdp: bool = False) -> None:
    """Every setting of `trainer` and `plan` the integration cannot run exactly (`fsdp`: context_parallel's)."""
    args = trainer.args
    _refuse_lone_accelerate_cpu_process(world_size)
    _refuse_engines(trainer, args)
    _refuse_own_context_parallelism(trainer, args)
    _refuse_topology(plan, world_size, fsdp)
    _refuse_loss_paths(trainer, args)


def _refuse_lone_accelerate_cpu_process(world_size: int) -> None:
    # `accelerate launch --cpu --num_processes N` (N > 1) without `--mpirun_hostfile`: accelerate 1.16's
    # simple launcher starts this one process, with MASTER_ADDR/PORT set but no RANK, and the stock
    # Trainer trains alone, silently; CP would fail on the world size or the missing RANK instead
    env = os.environ
    if world_size > 1 or "RANK" in env or "MASTER_ADDR" not in env:
        return
    if env.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1", "yes", "y", "on"):
        return
    raise CPConfigError(f"{_PREFIX}: `accelerate launch --cpu` started this process alone (MASTER_ADDR set, no "
                        "RANK): accelerate starts several CPU processes only through mpirun (--mpirun_hostfile); "
                        "launch with `accelerate launch --multi_gpu --num_processes N` (its torchrun; "
                        "use_cpu=True keeps gloo) or with torchrun")


def _refuse_engines(trainer: Any, args: Any) -> None:
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        # ZeRO partitions parameters and gradients behind its own engine: the CP gradient sum over
        # the cp group cannot be placed there
        raise CPConfigError(f"{_PREFIX}: DeepSpeed (args.deepspeed) is not supported with CP; "
                            "train with DDP (plain torchrun) instead")
    if getattr(args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False):
        # on CPU accelerate 1.16 drops its FSDP plugin and trains with DDP; on GPU its wrapping and
        # gradient scale under CP are not proven here (docs/hf_trainer.md, FSDP2)
        raise CPConfigError(f"{_PREFIX}: accelerate's FSDP (args.fsdp / fsdp_config) is not supported with CP; "
                            "remove it and pass context_parallel(trainer, plan, fsdp=True) for FSDP2 over dp x cp")
    if getattr(args, "n_gpu", 1) > 1:
        raise CPConfigError(f"{_PREFIX}: torch.nn.DataParallel (n_gpu={args.n_gpu} in one process) is not "
                            "supported; launch one process per device with torchrun")


def _refuse_own_context_parallelism(trainer: Any, args: Any) -> None:
    configs = [getattr(args, "parallelism_config", None),
               getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)]
    for config in (c for c in configs if c is not None):
        sizes = {name: getattr(config, name, 1) or 1 for name in ("cp_size", "sp_size", "tp_size")}
        taken = {name: size for name, size in sizes.items() if size > 1}
        if taken:
            raise CPConfigError(
                f"{_PREFIX}: args.parallelism_config sets {taken}: accelerate's/transformers' own context, "
                "sequence or tensor parallelism cannot run beside cpcompile's CP; remove them from "
                "parallelism_config and let the plan's cp_size split the sequence")


def _refuse_topology(plan: Plan, world_size: int, fsdp: bool) -> None:
    acc = plan.accelerator
    if acc.tp_size > 1 or acc.pp_size > 1 or acc.ep_size > 1:
        raise CPConfigError(f"{_PREFIX}: the plan sets tp_size={acc.tp_size}, pp_size={acc.pp_size}, "
                            f"ep_size={acc.ep_size}; under a Trainer only dp x cp is supported")
    if acc.dp_shard_size > 1 and not fsdp:
        raise CPConfigError(f"{_PREFIX}: the plan sets dp_shard_size={acc.dp_shard_size} (FSDP) but context_parallel "
                            "was not given fsdp=True; pass it, or name dp_replicate_size for DDP")
    if fsdp and acc.dp_replicate_size > 1:
        # HSDP (replicate x shard) is what cpcompile's trainer runs; not proven under the Trainer
        raise CPConfigError(f"{_PREFIX}: fsdp=True with dp_replicate_size={acc.dp_replicate_size} (HSDP) is not "
                            "supported; name dp_shard_size (or no dp size) in the plan")
    if world_size % acc.cp_size:
        raise CPConfigError(f"{_PREFIX}: world size {world_size} is not divisible by the plan's "
                            f"cp_size={acc.cp_size} (world = dp x cp)")
    dp = acc.dp_replicate_size * acc.dp_shard_size
    if dp > 1 and dp * acc.cp_size != world_size:
        raise CPConfigError(f"{_PREFIX}: the plan sets dp_replicate_size={acc.dp_replicate_size}, dp_shard_size="
                            f"{acc.dp_shard_size} and cp_size={acc.cp_size}, but the job has {world_size} processes")


def _refuse_loss_paths(trainer: Any, args: Any) -> None:
    # Each rank's loss must be its share of the CP=1 mean: only the model's own loss, given the
    # global `shift_labels` and `num_items_in_batch` by shard_batch, is that.
    if getattr(args, "label_smoothing_factor", 0):
        raise CPConfigError(f"{_PREFIX}: label_smoothing_factor={args.label_smoothing_factor} is not supported "
                            "with CP: the label smoother shifts each rank's slice locally")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise CPConfigError(f"{_PREFIX}: a compute_loss_func is not supported with CP: it would see each rank's "
                            "slice of the logits with unshifted labels")
    if not getattr(trainer, "model_accepts_loss_kwargs", False):
        raise CPConfigError(f"{_PREFIX}: {type(trainer.model).__name__}.forward takes no loss kwargs "
                            "(num_items_in_batch, shift_labels), which CP needs to compute each rank's share")


def packing_is_on(trainer: Any) -> bool:
    """TRL's `SFTConfig(packing=True)` or `padding_free=True` (its SFTTrainer keeps the outcome as
    `trainer.padding_free`): every batch must carry its documents."""
    args = trainer.args
    return bool(getattr(args, "packing", False) or getattr(args, "padding_free", False)
                or getattr(trainer, "padding_free", False))


def refuse_packing_without_positions(batch: Any, collator: str) -> None:
    """`collator`: the name of the Trainer's data collator, the cause to name."""
    if batch.get("position_ids") is None and batch.get("cu_seq_lens") is None:
        raise CPInputError(
            f"{_PREFIX}: packing is on (args.packing / args.padding_free) but the batch from the data collator "
            f"{collator} has no position_ids (keys: {sorted(batch)}); CP reads the packed documents from position "
            "ids restarting at 0: use a collator that returns them (DataCollatorWithFlattening, TRL's padding-free "
            "collator)")
