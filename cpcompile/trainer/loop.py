"""The training loop: build (mesh, data, model, CP, AC, FSDP2, AdamW + schedule), resume, then
one optimizer step per global batch, logging and checkpointing as the config says.

Each step: this replica's rows (`data.py`), `shard_batch` for this CP rank, this rank's summed
token loss (`train.loss: chunked`, the default: the model's last hidden state, then the head and
cross-entropy a chunk of tokens at a time, `lm_loss.py`; `full`: the logits, then
`F.cross_entropy`), `global_mean_loss` over `dp x cp` (each valid token counted once;
gradients are the rank's share, summed by FSDP2), backward, the global gradient norm (clipped
with `train.grad_clip`), AdamW, the LR schedule. Global rank 0 logs.

With `data.packing`, the rows carry `position_ids` restarting per document: `shard_batch` ends the
labels at document ends and hands the documents to the rewritten regions (SDPA, and GDN on either
backend).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..batch import IGNORE_INDEX, global_shift_labels, shard_batch
from ..dump import prepare_dump_dir
from ..errors import CPConfigError, PlanError, VerificationError
from ..loss import global_mean_loss
from ..mesh import build_mesh
from ..parity import FACTOR, FLOOR, within_precision
from ..pipeline import compile as cp_compile
from ..plan import Plan
from ..sequence_layout import required_multiple
from . import balance, checkpoint, lock, memory, resume_settings
from .config import TrainConfig, TrainSettings, pretrained_folder
from .data import TokenStream
from .lm_loss import chunked_loss_inputs, chunked_loss_sum, use_loss, uses_chunked_loss
from .export import export_folder, export_from_ranks
from .metrics import MetricsLog, check_finite, peak_memory_gib, relative, summary, warmup_steps
from .progress import Progress
from .sdpa_backend import only_sdpa_backend
from .startup import check_before_building
from .weights import load_pretrained, materialize
from .parallelize import (apply_activation_checkpointing, apply_fsdp, apply_input_offload, apply_tensor_parallel,
                          build_model, compile_layers, fsdp_mesh, gradient_scale, is_rank_zero, parameter_count,
                          rewritten_regions, use_cpcompile_gdn)


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


def rank_dump_dir(dump_dir: str | None, rank: int) -> str | None:
    """`<dump_dir>/rank<r>`, created now: a folder that cannot be written is an error naming the field."""
    if dump_dir is None:
        return None
    path = os.path.join(dump_dir, f"rank{rank}")
    try:
        prepare_dump_dir(path)
    except CPConfigError as exc:
        raise PlanError("train.dump_dir", str(exc)) from exc
    return path


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


def token_loss_sum(model, batch: dict, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the next-token cross-entropies over the valid `targets` (already shifted), in
    float32 at least (float64 for a float64 model): chunked when the model has the chunked loss
    installed (`use_loss`), else from the model's logits."""
    if uses_chunked_loss(model):
        return chunked_loss_sum(model, batch, targets)
    logits = model(**{**batch, "use_cache": False}).logits
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.flatten(0, 1).to(dtype), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def probe_inputs(model: torch.nn.Module, sharded: dict) -> dict:
    """What CP's probe forward calls the model with: the step's own call, so that with the
    chunked loss the probe never forms the whole logits either."""
    inputs, targets = _split_targets(sharded)
    return chunked_loss_inputs(inputs, targets) if uses_chunked_loss(model) else inputs


def _split_targets(batch: dict) -> tuple[dict, torch.Tensor]:
    """(model inputs, shifted targets) of a sharded batch: the loss is computed here, not by the model."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}
    return inputs, batch["shift_labels"]


@dataclasses.dataclass
class Trainer:
    """Everything one rank built; `step(i)` runs optimizer step i (0-based)."""

    config: TrainConfig
    mesh: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    stream: TokenStream
    replica: int
    references: dict
    gradient_scale: int
    progress: Progress

    def step(self, index: int) -> dict:
        settings = self.config.train
        cuda = settings.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        self.progress.at("forward", index + 1)
        batch = self.stream.batch(index, self.replica, self.config.dp_size)
        inputs, targets = _split_targets(shard_batch(batch, self.mesh, self.config.plan))
        with only_sdpa_backend(settings.sdpa_backend):  # the backward's checkpoint replays choose as the forward did
            local_sum = token_loss_sum(self.model, inputs, targets)
            loss = global_mean_loss(local_sum, (targets != IGNORE_INDEX).sum(), self.mesh)
            self.progress.at("backward")
            (loss * self.gradient_scale).backward()
        self.progress.at("optimizer")
        grad_norm = self._clip()
        record = {"step": index + 1, "loss": loss.item(), "grad_norm": grad_norm, "lr": lr}
        for name, reference in self.references.items():
            record[f"{name}_loss"] = _reference_step(reference, batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        record.update(seconds=seconds, tokens_per_s=settings.batch_size * settings.seq_len / seconds,
                      peak_memory_gib=peak_memory_gib(settings.device))
        return record

    def _clip(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return clip_gradients(grads, self.config.train.grad_clip)


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


def _reference_step(reference: tuple, batch: dict) -> float:
    """One step of an unrewritten copy on the whole batch (verify): its loss."""
    model, optimizer, scheduler = reference
    targets = global_shift_labels(batch["labels"])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    loss = token_loss_sum(model, inputs, targets) / (targets != IGNORE_INDEX).sum().clamp_min(1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss.item()


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
    dump = rank_dump_dir(settings.dump_dir, dist.get_rank())
    model = build_model(config.model, settings, parameters_on_meta=on_meta)
    use_loss(model, settings, settings.loss_compile_backend(config.plan.cp_size))
    stream = TokenStream(config.data, settings, model.config.get_text_config().vocab_size)
    first = shard_batch(stream.batch(0, replica, config.dp_size), mesh, config.plan)
    if config.plan.accelerator.tp_size > 1:
        apply_tensor_parallel(model, mesh)
    progress.at("compile")
    cp_compile(model, mesh, config.plan, dump_dir=dump, example_inputs=probe_inputs(model, first))
    progress.at("start")
    routed = use_cpcompile_gdn(model, settings.gdn_backend, config.data.packing, settings.gdn_checkpoint_around_core)
    if settings.gdn_checkpoint_around_core and not routed:
        raise PlanError("train.gdn_checkpoint_around_core", f"{type(model).__name__} has no GDN layer run outside CP: "
                                                            "nothing to checkpoint around")
    apply_activation_checkpointing(model, settings.ac_mode)
    if (backend := settings.layer_compile_backend(config.plan.cp_size)) is not None:
        compile_layers(model, backend)
    if settings.offload_layer_inputs:
        apply_input_offload(model, settings.ac_mode, pin_memory=settings.device == "cuda")
    sharding = fsdp_mesh(mesh)
    apply_fsdp(model, sharding, settings)
    if on_meta:
        materialize(model, settings.device)
    if pretrained is not None:
        progress.at("weights load")
        load_pretrained(model, pretrained)
        progress.at("start")
    optimizer, scheduler = build_optimizer(model, config)
    return Trainer(config, mesh, model, optimizer, scheduler, stream, replica, _references(config, pretrained),
                   gradient_scale(sharding), progress)


def _references(config: TrainConfig, pretrained: str | None) -> dict[str, tuple]:
    """The unrewritten copies `verify` trains on the whole batch: one in the run's dtype, and in
    bfloat16 one more in float32 to judge both against (same seed, or the same `pretrained`
    weights, so the same initial weights)."""
    settings = config.train
    if not settings.verify:
        return {}
    variants = {"reference": settings}
    if settings.dtype == "bfloat16":
        variants["fp32_reference"] = dataclasses.replace(settings, dtype="float32")
    references = {}
    for name, variant in variants.items():
        model = build_model(config.model, variant)
        use_loss(model, variant)
        if pretrained is not None:
            load_pretrained(model, pretrained)
        use_cpcompile_gdn(model, settings.gdn_backend, config.data.packing, settings.gdn_checkpoint_around_core)
        references[name] = (model, *build_optimizer(model, config))
    return references


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
                _verify(record, settings, trainer.mesh)
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
            log(f"verify: PASS: {_tolerance(settings)}, every step of {len(records)}")
        log(summary(records, settings.batch_size * settings.seq_len,
                    warmup=warmup_steps(settings.layer_compile_backend(config.plan.cp_size) is not None)))
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


def _tolerance(settings: TrainSettings) -> str:
    if settings.dtype == "bfloat16":
        return (f"the bfloat16 CP loss within {FACTOR:g}x the bfloat16 copy's difference from the float32 copy "
                f"+ {FLOOR:g}")
    return f"the CP loss within {settings.verify_rtol:.0e} (train.verify_rtol) of the unrewritten copy's"


def _verify(record: dict, settings: TrainSettings, mesh) -> None:
    """Raise `VerificationError` on every rank when this step's CP loss is off its reference.
    The ranks hold the same numbers; they still agree by one all-reduce over every rank (verify
    runs one replica: cp x tp ranks), so none waits alone at the next step's collectives."""
    failure = step_failure(record, settings, mesh.cp_size)
    failed = torch.tensor([float(failure is not None)], device=settings.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise VerificationError(failure or f"train.verify: step {record['step']}: another rank's reference "
                                           "disagreed with the CP loss beyond the tolerance")


def step_failure(record: dict, settings: TrainSettings, cp_size: int) -> str | None:
    """None when the step passes, else one line saying by how much it missed (NaN misses)."""
    loss, reference = record["loss"], record["reference_loss"]
    where = f"train.verify: step {record['step']}:"
    if "fp32_reference_loss" in record:
        exact = record["fp32_reference_loss"]
        cp_error, single_error = relative(loss, exact), relative(reference, exact)
        if within_precision(cp_error, single_error):
            return None
        return (f"{where} the bfloat16 CP={cp_size} loss {loss:.6f} is {cp_error:.1e} off the float32 copy's "
                f"{exact:.6f}, more than {FACTOR:g} x the bfloat16 copy's {single_error:.1e} + {FLOOR:g}")
    error = relative(loss, reference)
    if error <= settings.verify_rtol:
        return None
    return (f"{where} CP={cp_size} loss {loss:.6f} vs CP=1 loss {reference:.6f}, rel. diff {error:.1e} > "
            f"train.verify_rtol {settings.verify_rtol:.0e}")
