"""The Trainer's CP step at cpcompile's own trainer's speed: compiled decoder layers, and the loss
without its `[tokens, vocabulary]` logits.

Measured on one H100 (benchmarks/results/hf_trainer_gpu_2026-12-06_NVIDIA-H100.md): the Trainer at
CP=2, rank 0, 32K tokens a rank, ran at 0.48x cpcompile's trainer with its layers eager and the
model's own loss (float32 logits of 32K x 248K: 67 GiB peak). So, as cpcompile's trainer does:

- `compile_backend` (None: the device's default, inductor on CUDA and eager elsewhere, as the
  trainer's `compile_backend: null`): every decoder layer's forward under `torch.compile`, its CP
  regions inside (`cpcompile.compiled.compile_around_regions`), before FSDP2. The Trainer's
  gradient checkpointing wraps each layer's call, outside its forward: a compiled forward there
  saved 53 tensors in the forward and 33 in the recomputation on an H100, and the checkpoint
  refused the step (`CheckpointError`). So compiled layers take it over (`checkpoint_inside`): the
  layers' own flag off, the trainer's non-reentrant checkpoint around each forward, inside the
  compiled graph, as `cpcompile train` runs them;
- `loss` "chunked": the model's call, given the targets, returns the loss computed from the base
  model's last hidden state a chunk of tokens at a time (`linear_cross_entropy_sum`), the head's
  logits never whole. The same number as the model's own loss: the sum over valid targets divided
  by the Trainer's `num_items_in_batch`. It runs only where the Trainer's `compute_loss` is the
  stock one and the caller wants no outputs: a subclass that overrides `compute_loss` (TRL's
  `SFTTrainer` reads the logits for its token accuracy) and evaluation keep the model's own loss.
  `loss=None` picks "chunked" where it runs and "model" otherwise; `loss="chunked"` where it cannot
  run is refused.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..errors import CPConfigError, PlanError
from ..linear_cross_entropy import IGNORE_INDEX
from ..trainer.config_sections import DEFAULT_COMPILE_BACKENDS, EAGER, check_backend_name
from ..trainer.activation_checkpointing import EVERY_LAYER, checkpoint_layers
from ..trainer.lm_loss import check_head_takes_chunked_loss, logit_softcap, loss_sum

_PREFIX = "cpcompile.integrations.transformers"
LOSS_TARGETS = "cpcompile_loss_targets"  # the keyword the chunked forward takes the shifted targets by
LOSSES = ("chunked", "model")


def layer_compile_backend(compile_backend: str | None, device_type: str, trainer_compiles: bool) -> str | None:
    """The backend the decoder layers compile with, None to leave them eager; `trainer_compiles`:
    the Trainer's own `args.torch_compile`, which would compile the whole model around them again."""
    if compile_backend is None:
        compile_backend = DEFAULT_COMPILE_BACKENDS.get(device_type, EAGER)
    try:
        check_backend_name("compile_backend", compile_backend)
    except PlanError as exc:
        raise CPConfigError(f"{_PREFIX}: {exc}") from exc
    if compile_backend != EAGER and trainer_compiles:
        raise CPConfigError(f"{_PREFIX}: args.torch_compile compiles the whole model while context_parallel compiles "
                            f"its decoder layers ({compile_backend}); turn args.torch_compile off")
    return None if compile_backend == EAGER else compile_backend


def checkpoint_inside(layers: nn.ModuleList) -> bool:
    """Move the Trainer's gradient checkpointing (transformers' `GradientCheckpointingLayer`, around
    each layer's call) inside the layers' forwards, where compiling them keeps it whole; -> whether
    it was on. Every layer the Trainer checkpoints is checkpointed (non-reentrant) as before."""
    if not any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        return False
    for layer in layers:
        layer.gradient_checkpointing = False
    checkpoint_layers(layers, EVERY_LAYER)
    return True


def chunked_loss_wanted(trainer: Any, loss: str | None, mixin: type) -> bool:
    """Whether the chunked loss runs (`loss` as `context_parallel` takes it; `mixin`: the CP mixin,
    whose own compute_loss calls the next one); refuses "chunked" where it cannot run."""
    if loss is not None and loss not in LOSSES:
        raise CPConfigError(f"{_PREFIX}: loss={loss!r}; expected one of {LOSSES} or None (chunked where it can run)")
    if loss == "model":
        return False
    overrides = _class_overriding_compute_loss(type(trainer), mixin)
    if overrides is not None:
        if loss == "chunked":
            raise CPConfigError(f"{_PREFIX}: loss='chunked' needs the Trainer's own compute_loss, but "
                                f"{overrides.__name__} overrides it (it may read the logits); pass loss='model'")
        return False
    try:
        check_head_takes_chunked_loss(trainer.model)
    except PlanError as exc:
        if loss == "chunked":
            raise CPConfigError(f"{_PREFIX}: loss='chunked': {exc.reason} (here: pass loss='model')") from exc
        return False
    return True


def _class_overriding_compute_loss(cls: type, mixin: type) -> type | None:
    """The first class of `cls`'s order, other than `mixin`, that defines compute_loss, unless it is
    transformers' Trainer itself."""
    from transformers import Trainer

    for klass in cls.__mro__:
        if klass is not mixin and "compute_loss" in vars(klass):
            return None if klass is Trainer else klass
    return None


def install_chunked_loss(model: nn.Module, chunk_tokens: int, compile_backend: str | None) -> None:
    """A forward on `model` that, given `LOSS_TARGETS` (shifted, this rank's slice), returns the loss
    as the model's own would (a ModelOutput holding `loss` only); without them, the model as it was."""
    plain_forward = model.forward
    softcap = logit_softcap(model)

    @functools.wraps(plain_forward)
    def forward(*args, **kwargs):
        targets = kwargs.pop(LOSS_TARGETS, None)
        if targets is None:
            return plain_forward(*args, **kwargs)
        count = kwargs.pop("num_items_in_batch", None)
        total = loss_sum(model, kwargs, targets, chunk_tokens, softcap, compile_backend)
        count = (targets != IGNORE_INDEX).sum() if count is None else count
        return _output(loss=total / count)

    model.forward = forward


def with_loss_targets(batch: dict) -> dict:
    """The batch as the chunked forward takes it: labels out, the shifted targets in."""
    batch = dict(batch)
    batch.pop("labels", None)
    batch[LOSS_TARGETS] = batch.pop("shift_labels")
    return batch


def _output(loss: torch.Tensor):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss)
