"""`cpcompile train --dry-run`: everything a run builds, from a short probe batch, and no step; the
mesh, the plan's coverage, a memory estimate per rank (`memory.py`) and, given a budget, the
longest `train.seq_len` that fits it."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

import torch

from ..errors import PlanError
from ..plan import Plan
from ..sequence_layout import required_multiple
from . import balance, memory
from .config import TrainConfig
from .loop import build_trainer
from .parallelize import is_rank_zero, parameter_count, rewritten_regions
from .progress import Progress
from .startup import check_before_building


# Tokens per CP rank of the dry run's probe batch: enough for every method (a GDN conv kernel's
# halo, Head-Tail's two chunks), little enough that the probe forward costs nothing.
DRY_RUN_TOKENS_PER_RANK = 16


def dry_run_seq_len(config: TrainConfig) -> int:
    """The dry run's sequence length: `train.seq_len` cut to about `DRY_RUN_TOKENS_PER_RANK` per CP
    rank, a multiple of what the plan's layout needs."""
    plan = config.plan
    multiple = seq_len_multiple(plan)
    short = math.ceil(DRY_RUN_TOKENS_PER_RANK * plan.cp_size / multiple) * multiple
    return min(short, config.train.seq_len)


def dry_run(config: TrainConfig, log: Callable[[str], None] = print, memory_gib: float | None = None) -> dict:
    """Build everything a run builds, print the mesh, the plan's coverage and a memory estimate
    per rank, and run no step; -> the same facts as a dict. The model is built and rewritten
    from a short probe batch (`dry_run_seq_len`): the regions and their methods do not depend on
    the length, and a probe forward at `train.seq_len` could take minutes; the estimate is for
    `train.seq_len`. With a memory budget per rank (`memory_gib`, else on CUDA the device's own),
    also the longest `train.seq_len` whose estimate fits it (`memory.longest_seq_len`)."""
    budget = memory_budget_gib(config.train.device, memory_gib)
    check_before_building(config)
    probe = dry_run_seq_len(config)
    probe_config = dataclasses.replace(config, train=dataclasses.replace(config.train, seq_len=probe))
    progress = Progress(config.train.collective_timeout_s)
    with progress.reporting():
        trainer = build_trainer(probe_config, progress, load_weights=False)
    accelerator = config.plan.accelerator
    regions = rewritten_regions(trainer.model)
    parameters = parameter_count(trainer.model)
    estimate = memory_estimate(config, parameters, trainer.model.config)
    if is_rank_zero():
        log(f"mesh: {accelerator.world_size_formula()}; FSDP2 over dp_shard x cp = "
            f"{accelerator.dp_shard_size * accelerator.cp_size} ranks, replicated over dp_replicate = "
            f"{accelerator.dp_replicate_size}; tensor parallel over tp = {accelerator.tp_size}")
        log(f"plan coverage: {len(regions)} region(s) rewritten for CP={config.plan.cp_size} (traced on a probe "
            f"batch of {probe} of train.seq_len's {config.train.seq_len} tokens per sequence)")
        for name, method in regions:
            log(f"  {name}: {method}")
        log(f"memory estimate per rank (GiB{busiest_rank_note(config)}): "
            + ", ".join(f"{k} {v:.3g}" for k, v in estimate.items()))
        log(balance.describe_imbalance(config, parameters, trainer.model.config))
    facts = {"regions": regions, "memory_gib": estimate, "probe_seq_len": probe,
             "parameters": parameters, "model_config": trainer.model.config,
             "rank_imbalance": balance.imbalance(config, parameters, trainer.model.config)}
    if budget is not None:
        facts["longest_seq_len"] = memory.longest_seq_len(config, parameters, trainer.model.config, budget,
                                                          seq_len_multiple(config.plan))
        if is_rank_zero():
            log(describe_longest(facts["longest_seq_len"], budget))
    return facts


def busiest_rank_note(config: TrainConfig) -> str:
    """Which CP rank the dry run's estimate is for, when the ranks differ (the one holding the most)."""
    cp = config.plan.accelerator.cp_size
    return "" if cp == 1 else f"; CP rank {memory.busiest_rank(memory.sdpa_method(config), cp)} of {cp}, the most"


def memory_budget_gib(device: str, memory_gib: float | None) -> float | None:
    """The per-rank memory the dry run fits the length to: `memory_gib`, else the total of the CUDA
    device this rank will use (torchrun's LOCAL_RANK, as `build_mesh` picks it), else none."""
    if memory_gib is not None:
        if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or not memory_gib > 0:
            raise PlanError("--memory-gib", f"must be a positive number of GiB, got {memory_gib!r}")
        return float(memory_gib)
    if device == "cuda" and torch.cuda.is_available():
        local_rank = os.environ.get("LOCAL_RANK")
        device = int(local_rank) if local_rank is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(device).total_memory / memory.GIB
    return None


def seq_len_multiple(plan: Plan) -> int:
    """What `train.seq_len` must be a multiple of under the plan's layout (1 without one)."""
    layout = plan.layout()
    return required_multiple(layout, plan.cp_size) if layout is not None else 1


def describe_longest(seq_len: int, budget_gib: float) -> str:
    """The dry run's line for `memory.longest_seq_len`'s answer."""
    if seq_len == 0:
        return (f"longest train.seq_len within {budget_gib:.4g} GiB a rank: none (the estimate's parts that do not "
                f"depend on the length exceed it)")
    return (f"longest train.seq_len within {budget_gib:.4g} GiB a rank, by the estimate: {seq_len} tokens "
            f"(its accuracy against measured peaks: docs/trainer.md, 'The memory estimate')")


def memory_estimate(config: TrainConfig, params: int, model_config, rank: int | None = None) -> dict[str, float]:
    """The per-rank peak of a steady-state step in GiB, term by term and `total`: parameters,
    gradients and AdamW states sharded by FSDP2, FSDP2's gathered buffers, the saved activations,
    the loss's buffers, one layer's recompute and backward (`trainer/memory.py` says what each
    term assumes). For CP rank `rank`; None: the rank whose attention holds the most, the job's peak."""
    return memory.estimate(config, params, model_config, rank)
