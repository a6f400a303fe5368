"""FSDP2 over dp x cp in a Hugging Face `Trainer` (`context_parallel(trainer, plan, fsdp=True)`).

accelerate's own FSDP (`TrainingArguments(fsdp=..., fsdp_config=...)`) is not used: accelerate 1.16
only turns it on for GPU-like devices (on CPU it keeps `MULTI_CPU`, drops the plugin and trains with
DDP, silently), so it cannot be proven equal to CP=1 in this project's gloo runs (docs/hf_trainer.md).
Instead the integration shards the model itself, as cpcompile's trainer does: PyTorch's
`fully_shard` on every decoder layer, then the root, over the flattened dp_shard x cp mesh
(`trainer.parallelize.fsdp_mesh`). In the same order as that trainer: after `cpcompile.compile`
(which refuses DTensor parameters inside a region), so at the first batch, when the Trainer has
already built its optimizer: that optimizer (no state yet) is pointed at the sharded parameters.
The rewritten regions read the parameters FSDP2's hooks gathered at call time.

The Trainer is then told the model reduces its own gradients (`is_distributed_loading_by_transformers`,
transformers' flag for a model sharded at load time): accelerate prepares it without DDP, and
gradient accumulation defers FSDP2's reduce-scatter to the window's last micro-batch. The gradient
scale is the DDP path's: FSDP2 averages over its dp x cp ranks, which the Trainer's multiplication of
the loss by its number of processes undoes (docs/hf_trainer.md, Gradients).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..errors import CPConfigError
from ..mesh import CPMesh
from ..trainer.parallelize import decoder_layers, fsdp_mesh

_PREFIX = "cpcompile.integrations.transformers"


def leave_reduction_to_model(trainer: Any) -> None:
    """Before training: the Trainer will not wrap the model in DDP (FSDP2 comes at the first batch)."""
    refuse_fsdp_trainer(trainer)
    if not hasattr(trainer, "is_distributed_loading_by_transformers"):
        # an older Trainer would wrap the model in DDP too, and its gradients would be reduced twice
        import transformers

        raise CPConfigError(f"{_PREFIX}: fsdp=True needs a Trainer that can leave gradient reduction to the model "
                            f"(`is_distributed_loading_by_transformers`), which transformers {transformers.__version__} "
                            "lacks; upgrade transformers (5.25 is tested) or train with DDP (fsdp=False)")
    # read by Trainer._prepare_for_training (no DDP: prepared for autocast only) and its accumulation
    # loop (once sharded, FSDP2's reduce-scatter deferred to the window's last micro-batch)
    trainer.is_distributed_loading_by_transformers = True


def shard_compiled_model(trainer: Any, mesh: CPMesh) -> None:
    """`fully_shard` the compiled `trainer.model` over dp x cp; the optimizer, if built, follows."""
    model = trainer.model
    if trainer.model_wrapped is not model:  # DDP around it would reduce the gradients a second time
        raise CPConfigError(f"{_PREFIX}: fsdp=True, but the Trainer wrapped the model in "
                            f"{type(trainer.model_wrapped).__name__}; FSDP2 reduces its gradients itself")
    before = dict(model.named_parameters())
    sharding = fsdp_mesh(mesh)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=sharding)
    fully_shard(model, mesh=sharding)
    if trainer.optimizer is not None:
        _point_optimizer_at(trainer.optimizer, before, dict(model.named_parameters()))


def _point_optimizer_at(optimizer: torch.optim.Optimizer, before: dict, after: dict) -> None:
    """Replace each parameter `fully_shard` replaced (same name) in the optimizer's groups."""
    if any(len(state) for state in optimizer.state.values()):
        # a resumed optimizer's state is per full parameter; resharding it is not done here
        raise CPConfigError(f"{_PREFIX}: fsdp=True shards the model at the first batch, but the optimizer already "
                            "has state (resumed from a checkpoint?); start without optimizer state")
    sharded = {id(before[name]): after[name] for name in before}
    for group in optimizer.param_groups:
        group["params"] = [sharded[id(p)] for p in group["params"]]


def refuse_fsdp_trainer(trainer: Any) -> None:
    """What `fsdp=True` cannot run: a model already wrapped or sharded, and checkpoints with optimizer state."""
    if trainer.model_wrapped is not trainer.model or isinstance(trainer.model, FSDPModule):
        raise CPConfigError(f"{_PREFIX}: fsdp=True needs the plain model; {type(trainer.model_wrapped).__name__} "
                            "is already wrapped or sharded (apply context_parallel before training)")
    args = trainer.args
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if strategy == "no" or args.save_only_model:
        return
    # the Trainer saves the optimizer from rank 0 alone: with FSDP2 that is rank 0's shard of its state
    raise CPConfigError(f"{_PREFIX}: fsdp=True with save_strategy={strategy!r} saves only rank 0's shard "
                        "of the optimizer state; set save_only_model=True (or save_strategy='no')")


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on the CPU of rank 0 (empty on the other ranks); every rank must call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)
