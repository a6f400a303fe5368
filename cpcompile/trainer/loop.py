"""The training run: build (mesh, data, model, its parallelization `parallelize.parallelize_model`:
TP, CP, AC, compile, offload, FSDP2; AdamW + schedule), resume, then
one optimizer step per global batch, logging and checkpointing as the config says.

One step is `step.py` (`Trainer.step`: this replica's rows, `shard_batch` for this CP rank, the
summed token loss, `global_mean_loss` over `dp x cp`, backward, the clipped gradient norm, AdamW,
the LR schedule); the optimizer and clipping `optimizer.py`; `train.verify`'s unrewritten copies
and their judgement `verify.py`; `--dry-run` `dry_run.py`. Global rank 0 logs.

With `data.packing`, the rows carry `position_ids` restarting per document: `shard_batch` ends the
labels at document ends and hands the documents to the rewritten regions (SDPA, and GDN on either
backend).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
from typing import Callable

import torch.distributed as dist

from ..batch import shard_batch
from ..dump import prepare_dump_dir, resolve_dump_dir
from ..errors import CPConfigError, PlanError
from ..mesh import build_mesh
from ..plan import Plan
from . import checkpoint, lock, resume_settings
from .config import TrainConfig, pretrained_folder
from .data import TokenStream
from .export import export_folder, export_from_ranks
from .lm_loss import use_loss
from .metrics import MetricsLog, check_finite, summary, warmup_steps
from .optimizer import build_optimizer
from .parallelize import build_model, gradient_scale, is_rank_zero, parallelize_model
from .progress import Progress
from .startup import check_before_building
from .step import Trainer, probe_inputs
from .verify import build_references, tolerance, verify_step
from .weights import load_pretrained, materialize


def check_world_size(plan: Plan) -> None:
    """One process per rank of the mesh: say how to launch when the job has another number."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    want = plan.accelerator.world_size
    if world == want:
        return
    launch = (f"launch one per rank: python -m cpcompile train --nproc-per-node {want} CONFIG (or torchrun "
              f"--nproc-per-node {want} -m cpcompile ...)")
    if want == plan.cp_size:  # CP only: name the one size that sets the count
        raise PlanError("accelerator.cp_size", f"is {want} but the job has {world} process(es); {launch}")
    raise PlanError("accelerator", f"needs {plan.accelerator.world_size_formula()} processes but the job has "
                                   f"{world}; {launch}")


def rank_dump_dir(dump_dir: str | None, rank: int, world_size: int) -> str | None:
    """The folder `compile` writes this rank's dump to (`dump.resolve_dump_dir`: `<dump_dir>/rank<r>`
    in a job of more than one process, else `<dump_dir>`), created now: a folder that cannot be
    written is an error naming the field, before anything is built."""
    if dump_dir is None:
        return None
    path = resolve_dump_dir(dump_dir, rank, world_size)
    try:
        prepare_dump_dir(path)
    except CPConfigError as exc:
        raise PlanError("train.dump_dir", str(exc)) from exc
    return str(path)


def build_trainer(config: TrainConfig, progress: Progress | None = None, load_weights: bool = True,
                  from_checkpoint: bool = False) -> Trainer:
    """Build this rank's trainer. With `model.path` pretrained weights and `load_weights` (false
    when a checkpoint will overwrite them, and for a dry run), the model is built with its
    parameters on the meta device, so that no rank holds it whole, and they are loaded last,
    into the parallelized model's shards (weights.py). `from_checkpoint`: the caller loads a DCP
    checkpoint into the shards next (resume), so the model is built on meta too and left empty."""
    settings = config.train
    pretrained = pretrained_folder(config.model) if load_weights else None
    # weights from files: no rank builds the whole model; the CP rewrite probes and traces it with
    # fake parameters (cpcompile/meta_params.py), FSDP2 shards it, the load fills the shards
    on_meta = pretrained is not None or from_checkpoint
    progress = progress or Progress(settings.collective_timeout_s)
    check_world_size(config.plan)
    progress.at("start")
    mesh = build_mesh(config.plan.accelerator, device_type=settings.device,
                      timeout=datetime.timedelta(seconds=settings.collective_timeout_s))
    progress.attach_board()
    root = mesh.root
    replica = root.get_local_rank("dp_replicate") * config.plan.accelerator.dp_shard_size + \
        root.get_local_rank("dp_shard")
    rank_dump_dir(settings.dump_dir, dist.get_rank(), dist.get_world_size())  # said now; compile writes there
    model = build_model(config.model, settings, parameters_on_meta=on_meta)
    use_loss(model, settings, settings.loss_compile_backend())
    stream = TokenStream(config.data, settings, model.config.get_text_config().vocab_size)
    first = shard_batch(stream.batch(0, replica, config.dp_size), mesh, config.plan)
    sharding = parallelize_model(model, mesh, config, probe_inputs(model, first), progress)
    if on_meta:
        materialize(model, settings.device)
    if pretrained is not None:
        progress.at("weights load")
        load_pretrained(model, pretrained)
        progress.at("start")
    optimizer, scheduler = build_optimizer(model, config)
    return Trainer(config, mesh, model, optimizer, scheduler, stream, replica, build_references(config, pretrained),
                   gradient_scale(sharding), progress)


def train(config: TrainConfig, log: Callable[[str], None] = print, stop_after: int | None = None) -> list[dict]:
    """Run the loop; -> one record per step run: step, loss, grad_norm, lr, seconds, tokens_per_s,
    peak_memory_gib (and with `verify` reference_loss, fp32_reference_loss in bfloat16). Call
    inside an initialised process group of the mesh's size (torchrun), or let `build_mesh` make
    one (with `train.collective_timeout_s`). `stop_after` ends the run after that step (as a
    preempted job would), schedule unchanged. With `checkpoint.folder`, a checkpoint is saved
    every `interval` steps and after the last step run; the latest one there is resumed from when
    `checkpoint.resume`; with `checkpoint.export`, the last one is then written as a Hugging Face
    folder, `<checkpoint.folder>/hf` (export.py). A collective that fails is a `CollectiveError`
    naming the step and phase (progress.py)."""
    progress = Progress(config.train.collective_timeout_s)
    with progress.reporting():
        latest = check_before_building(config)
        with _folder_lock(config, log):
            return _train(config, log, stop_after, progress, latest)


def _folder_lock(config: TrainConfig, log: Callable[[str], None]):
    """Global rank 0 holds the checkpoint folder's lock for the run (lock.py); the others, and a
    run without a folder, hold nothing."""
    folder = config.checkpoint.folder
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return lock.holding(folder, log) if folder is not None and rank == 0 else contextlib.nullcontext()


def _train(config: TrainConfig, log: Callable[[str], None], stop_after: int | None, progress: Progress,
           latest: int | None) -> list[dict]:
    settings, saving = config.train, config.checkpoint
    trainer = build_trainer(config, progress, load_weights=latest is None, from_checkpoint=latest is not None)
    first = 0
    if latest is not None:
        progress.at("checkpoint load")
        first = checkpoint.load(saving.folder, latest, trainer.model, trainer.optimizer, trainer.scheduler, config,
                                trainer.references)
        if is_rank_zero():
            log(resumed_line(config, latest))
    last = settings.steps if stop_after is None else min(settings.steps, stop_after)
    metrics = MetricsLog(settings.metrics_file, settings.steps, log, is_rank_zero(), resumed_at=first)
    records = []
    try:
        for index in range(first, last):
            record = trainer.step(index)
            records.append(record)
            metrics.step(record)
            check_finite(record)
            if settings.verify:
                progress.at("verify")
                verify_step(record, settings, trainer.mesh)
            done = index + 1
            if saving.folder and ((saving.interval and done % saving.interval == 0) or done == last):
                progress.at("checkpoint save")
                checkpoint.save(saving.folder, done, trainer.model, trainer.optimizer, trainer.scheduler,
                                checkpoint.run_facts(config), trainer.references)
    finally:
        metrics.close()
    if saving.export:
        progress.at("export")
        step = checkpoint.step_folder(saving.folder, checkpoint.latest_step(saving.folder))
        export_from_ranks(step, export_folder(saving.folder))
        if is_rank_zero():
            log(f"exported {step} as a Hugging Face folder: {export_folder(saving.folder)}")
    if is_rank_zero():
        if settings.verify and records:
            log(f"verify: PASS: {tolerance(settings)}, every step of {len(records)}")
        log(summary(records, settings.batch_size * settings.seq_len,
                    warmup=warmup_steps(settings.layer_compile_backend() is not None)))
    return records


def resumed_line(config: TrainConfig, step: int) -> str:
    """The resumed run's first line: where from, and what `checkpoint.allow_changes` let change."""
    folder = checkpoint.step_folder(config.checkpoint.folder, step)
    with open(os.path.join(folder, checkpoint.META_FILE), encoding="utf-8") as handle:
        meta = json.load(handle)
    changed = resume_settings.check(meta, config, os.path.join(folder, checkpoint.META_FILE))
    line = f"resumed from {folder} at step {meta['step']}"
    if changed:
        line += f"; changed on purpose (checkpoint.allow_changes): {resume_settings.describe(changed)}"
    return line
