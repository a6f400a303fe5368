"""Context parallelism in a Hugging Face `Trainer` (or TRL's `SFTTrainer`, or any subclass) with two lines:

    from cpcompile.integrations.transformers import context_parallel
    trainer = context_parallel(Trainer(model=model, args=args, train_dataset=ds, data_collator=collator),
                               plan="plan.yaml")   # `cpcompile plan MODEL --cp N --seq-len S` writes one
    trainer.train()

launched by `torchrun` (or `accelerate launch --multi_gpu`) as before: world = dp x cp, dp = world /
the plan's cp_size. What changes, and why each step keeps the CP=1 numbers (docs/hf_trainer.md):

- data: every rank of a cp group reads the same global batch (`hf_data.shard_over_dp`);
- the first batch compiles the model (`cpcompile.compile`, in place: parameter names unchanged, so
  `save_model` writes a normal checkpoint); every batch is cut by `cpcompile.shard_batch` (TRL's
  padding-free varlen keys checked against the position ids and taken out first: `hf_data`);
- loss: `num_items_in_batch` counts each target once over the dp groups (`hf_data.count_targets`),
  so each rank's HF loss is its share of the CP=1 mean. The Trainer's own scaling by the number of
  processes then undoes DDP's mean over dp x cp: the gradient is the sum over the cp group and the
  mean over dp, the logged loss the CP=1 loss. Evaluation runs the same path (loss only);
- `fsdp=True`: FSDP2 over dp x cp instead of DDP (`hf_fsdp`: PyTorch's `fully_shard`, the same
  gradient scale); `save_model` gathers the full state dict;
- speed (`hf_step`): the decoder layers compiled (inductor on CUDA), and the loss computed without
  the logits where the Trainer's own compute_loss runs, as cpcompile's trainer does;
- what it cannot run exactly is refused before any step (`hf_refusals`).

`ContextParallelMixin` is the same thing as a class, for a script that defines its own subclass:
``class MyTrainer(ContextParallelMixin, SFTTrainer)``, then ``context_parallel(MyTrainer(...), plan)``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..batch import shard_batch
from ..errors import CPConfigError
from ..mesh import CPMesh, build_mesh
from ..pipeline import compile as cp_compile
from ..plan import Plan, load_plan
from ..trainer.parallelize import compile_layers, decoder_layers  # the trainer's: every layer's forward compiled
from .hf_data import count_targets, shard_over_dp, without_varlen_keys
from .hf_fsdp import full_state_dict, leave_reduction_to_model, shard_compiled_model
from .hf_refusals import packing_is_on, refuse_packing_without_positions, refuse_unsupported_trainer
from .hf_step import (checkpoint_inside, chunked_loss_wanted, install_chunked_loss, layer_compile_backend,
                      with_loss_targets)

__all__ = ["ContextParallelMixin", "context_parallel"]


@dataclass
class CPSetup:
    """What a context-parallel trainer carries: the plan, its mesh and this rank's place in it."""

    plan: Plan
    mesh: CPMesh
    dp_size: int
    dp_rank: int
    pad_token_id: int
    packing: bool
    fsdp: bool = False
    layer_backend: str | None = None  # the decoder layers' torch.compile backend; None: eager
    chunked_loss: bool = False
    compiled: bool = False

    @property
    def cp_size(self) -> int:
        return self.mesh.cp_size


def context_parallel(trainer: Any, plan: Any, *, fsdp: bool = False, compile_backend: str | None = None,
                     loss: str | None = None, loss_chunk_tokens: int = 4096, dump_dir: str | None = None) -> Any:
    """`trainer` (a `transformers.Trainer` or subclass, not yet trained) made context parallel by
    `plan` (a YAML path, a dict or a `cpcompile.Plan`); returns the same object, its class given
    `ContextParallelMixin`. `fsdp`: shard the model with FSDP2 over dp x cp (PyTorch's `fully_shard`,
    applied here) instead of the Trainer's DDP. `compile_backend`: the decoder layers' `torch.compile`
    backend ("eager": none; None: inductor on CUDA, eager elsewhere). `loss`: "chunked" (without the
    logits, `loss_chunk_tokens` tokens at a time), "model" (the model's own) or None (chunked where the
    Trainer's own compute_loss runs): `hf_step`. `dump_dir`: cpcompile's debug dump of the rewritten regions."""
    if getattr(trainer, "_cp", None) is not None:
        raise CPConfigError("cpcompile.integrations.transformers: context_parallel was already applied to this trainer")
    if isinstance(loss_chunk_tokens, bool) or not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 1:
        raise CPConfigError(f"cpcompile.integrations.transformers: loss_chunk_tokens={loss_chunk_tokens!r}; "
                            "expected a positive int")
    plan = load_plan(plan)
    world = dist.get_world_size() if dist.is_initialized() else 1
    refuse_unsupported_trainer(trainer, plan, world, fsdp)
    layer_backend = layer_compile_backend(compile_backend, trainer.args.device.type,
                                          bool(getattr(trainer.args, "torch_compile", False)))
    chunked = chunked_loss_wanted(trainer, loss, ContextParallelMixin)
    if chunked:
        install_chunked_loss(trainer.model, loss_chunk_tokens, layer_backend)
    plan = _plan_for_world(plan, world, fsdp)
    mesh = build_mesh(plan.accelerator, device_type=trainer.args.device.type)
    cp = plan.cp_size
    # cpcompile's mesh is (pp, dp_replicate, dp_shard, cp, tp) with pp = tp = 1 here: cp is inner
    dp_rank = (dist.get_rank() if dist.is_initialized() else 0) // cp
    if fsdp:
        leave_reduction_to_model(trainer)
    trainer._cp = CPSetup(plan, mesh, world // cp, dp_rank, _pad_token_id(trainer), packing_is_on(trainer), fsdp,
                          layer_backend, chunked)
    trainer._cp_dump_dir = dump_dir
    if not isinstance(trainer, ContextParallelMixin):
        trainer.__class__ = _with_mixin(type(trainer))
    return trainer


class ContextParallelMixin:
    """The `Trainer` methods CP changes; the rest is the Trainer's own. Apply with `context_parallel`."""

    _cp: CPSetup | None = None

    # ---------------------------------------------------------------- data: one batch per cp group

    def get_train_dataloader(self):
        return shard_over_dp(super().get_train_dataloader(), self._cp.dp_size, self._cp.dp_rank)

    def get_eval_dataloader(self, eval_dataset=None):
        return shard_over_dp(super().get_eval_dataloader(eval_dataset), self._cp.dp_size, self._cp.dp_rank)

    def get_test_dataloader(self, test_dataset):
        return shard_over_dp(super().get_test_dataloader(test_dataset), self._cp.dp_size, self._cp.dp_rank)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        return count_targets(batch_samples, device, self._cp.cp_size, self.args.average_tokens_across_devices)

    def _track_num_input_tokens(self, inputs):
        # the Trainer sums the tokens of every process: each cp rank reported the same global batch
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self._cp.cp_size

    # ---------------------------------------------------------------- the step: shard, compile, loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        local = self._local_batch(inputs, num_items_in_batch)
        num_items_in_batch = local.pop("num_items_in_batch", num_items_in_batch)
        self._compile_once(local)
        if self._cp.chunked_loss and not return_outputs and "shift_labels" in local:
            local = with_loss_targets(local)  # the model's call returns the loss without the logits
        # outputs only when asked: TRL's SFTTrainer runs one more forward (for the logits) to return them
        result = super().compute_loss(model, local, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        loss, outputs = result if return_outputs else (result, None)
        if not self.args.average_tokens_across_devices:
            # the loss is this rank's share of its cp group's mean, and DDP divides by dp x cp
            loss = loss * self._cp.cp_size
        if not model.training:
            loss = _mean_over(loss, self._cp.mesh.cp_group)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not prediction_loss_only and (self.compute_metrics is not None
                                         or self.preprocess_logits_for_metrics is not None):
            raise CPConfigError("cpcompile.integrations.transformers: under CP each rank holds a slice of the "
                                "logits; evaluation computes the loss only (compute_metrics is not supported)")
        if not any(inputs.get(name) is not None for name in self.label_names):
            # without labels the Trainer would run the model on the unsharded batch, for logits only
            return None, None, None
        return super().prediction_step(model, inputs, True, ignore_keys=ignore_keys)

    # ---------------------------------------------------------------- FSDP2 (fsdp=True): accumulation, saving

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        # the Trainer's own reads the model's `config.distributed_config` (a model sharded by
        # from_pretrained), which a model sharded here has not: one dp x cp mesh, no replicas
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._cp.fsdp:
            return super().save_model(output_dir, _internal_call)
        state_dict = full_state_dict(self.model)  # a collective: every rank, rank 0 gets the weights
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _local_batch(self, inputs: dict, num_items_in_batch) -> dict:
        setup = self._cp
        batch = without_varlen_keys(dict(inputs))  # TRL's padding-free batches: position ids and flash varlen keys
        if setup.packing:
            refuse_packing_without_positions(batch, type(self.data_collator).__name__)
        if num_items_in_batch is not None:
            batch["num_items_in_batch"] = num_items_in_batch  # the Trainer's count passes through
        # right padding to the layout's multiple: ids masked out of the loss (label -100) and,
        # being after every real token, causally invisible to them
        return shard_batch(batch, setup.mesh, setup.plan, pad=True, pad_token_id=setup.pad_token_id)

    def _compile_once(self, local: dict) -> None:
        if self._cp.compiled:
            return
        example = {k: v for k, v in local.items() if k not in ("labels", "shift_labels")}
        cp_compile(self.model, self._cp.mesh, self._cp.plan, example_inputs=example,
                   dump_dir=getattr(self, "_cp_dump_dir", None))
        if self._cp.layer_backend is not None:
            checkpoint_inside(decoder_layers(self.model))  # the Trainer's checkpoint, inside the compiled forward
            compile_layers(self.model, self._cp.layer_backend)  # before FSDP2
        if self._cp.fsdp:
            shard_compiled_model(self, self._cp.mesh)  # after compile, as cpcompile's trainer does
        self._cp.compiled = True


def _mean_over(loss: torch.Tensor, group) -> torch.Tensor:
    """The mean over the cp group: one value per group, so the eval gather (which may drop the
    copies of a short last batch) sees the same number on every rank of a group."""
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return loss / dist.get_world_size(group)


def _plan_for_world(plan: Plan, world: int, fsdp: bool) -> Plan:
    """The plan with dp = world / cp when it names no dp size (a suggested plan names cp only):
    replicated (DDP), or sharded with `fsdp` (FSDP2 over dp_shard x cp)."""
    acc = plan.accelerator
    if acc.world_size == world:
        return plan
    dp_name = "dp_shard_size" if fsdp else "dp_replicate_size"
    acc = dataclasses.replace(acc, **{dp_name: world // acc.cp_size})
    return dataclasses.replace(plan, accelerator=acc).validate()


def _pad_token_id(trainer: Any) -> int:
    for source in (getattr(trainer, "processing_class", None), getattr(trainer.model, "config", None)):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


_CP_CLASSES: dict[type, type] = {}


def _with_mixin(cls: type) -> type:
    """`cls` with `ContextParallelMixin` first in its method order (one class per trainer class):
    every Trainer subclass keeps its own behaviour and gets CP's data, loss and evaluation."""
    if cls not in _CP_CLASSES:
        _CP_CLASSES[cls] = type(f"ContextParallel{cls.__name__}", (ContextParallelMixin, cls),
                                {"__module__": cls.__module__, "__doc__": cls.__doc__})
    return _CP_CLASSES[cls]
