"""`compile` on a model whose parameters are on the meta device.

A model loaded shard by shard (each rank reading only its own slices of a checkpoint, after
FSDP2 has sharded it) is built with its parameters on the meta device, so that no rank ever
holds all of them. The CP rewrite runs before FSDP2 (on the unsharded modules), so it meets
that model with no parameter values at all. What the rewrite needs of the parameters:

- the probe forward (capture.py): each region's call and which modules run a core. Of what the
  parameters produce (hidden states) it keeps shapes, dtypes and devices only;
- the trace (`torch.export`): makes fake tensors of every input and parameter anyway;
- the passes: values only of what the batch alone decides (an attention mask's pattern, read
  by `passes/graph_utils.evaluate_node` from the mask's own inputs);
- the audit for sequence mixing (audit/mixers.py): a module's outputs before and after one
  token of its input changes. Numbers, but not the trained ones: whether a module mixes
  positions is a property of its code, which any generic weights show.

So for the whole of `compile` (`fake_parameters`) each meta parameter is replaced by a fake
tensor (`FakeTensor`) of its shape, stride and dtype on the device of the example batch, tied
parameters by one. With no fake mode active, an op that touches a fake tensor runs fake
(metadata only: no memory, and a functional collective on it is its fake kernel, so no
communication) while an op on real tensors alone runs for real: the masks, positions and rotary
frequencies built from the batch stay real, the hidden states are fake. (Not under an active
fake mode: that would make the batch fake too, and the mask checks, like transformers' own mask
code asking `mask.all()`, need its values.) The graphs traced are the same as from real weights
(tests/pipeline/test_meta_parameters.py compares them); a signature first met later, in
training, is traced on the real parameters the model has by then. The audit calls each module
it checks with random stand-ins (`real_stand_ins`): its fake inputs and its own parameters
replaced by seeded random values while it runs, its real inputs kept.

Buffers must be real (rotary frequencies are computed from them and are in no checkpoint):
`trainer/weights.parameters_on_meta` builds them so. A meta buffer is refused.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from .errors import CPInputError, UnsupportedError

# the audit's stand-in values: the same on every rank (so that every rank's audit finds the
# same), parameters at transformers' usual initializer range
STAND_IN_SEED = 20251
STAND_IN_PARAMETER_STD = 0.02


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding a parameter's values on this rank: a DTensor's local shard, else itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def is_fake(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and isinstance(_local(value), FakeTensor)


def on_meta(tensor: torch.Tensor) -> bool:
    return _local(tensor).is_meta


def has_meta_parameters(model: nn.Module) -> bool:
    return any(on_meta(p) for p in model.parameters())


def example_device(example: Any) -> torch.device:
    """The device the example batch is on: the one the model will run on, and so the fake
    parameters' device."""
    tensors = [leaf for leaf in pytree.tree_leaves(example) if isinstance(leaf, torch.Tensor)]
    if not tensors or tensors[0].is_meta:
        raise CPInputError("the model's parameters are on the meta device: pass example_inputs= holding the batch "
                           "on the device the model will run on (cpcompile cannot make one from meta parameters)")
    return tensors[0].device


def check_buffers_real(model: nn.Module) -> None:
    meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta:
        raise CPInputError(f"buffer {meta[0]!r} ({len(meta)} buffer(s)) is on the meta device: compile computes "
                           "from the buffers (rotary frequencies, in no checkpoint) in its probe forward; build the "
                           "model with only its parameters on meta (cpcompile.trainer.weights.parameters_on_meta)")


@contextlib.contextmanager
def fake_parameters(model: nn.Module, device: torch.device) -> Iterator[None]:
    """While inside: every meta parameter of `model` is a fake tensor on `device` (a DTensor's
    local shard, for tensor parallelism); the meta ones are put back after, also on error."""
    check_buffers_real(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    stand_ins: dict[int, nn.Parameter] = {}  # one per parameter object: tied parameters stay tied
    swapped = []
    try:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not on_meta(param):
                    continue
                if id(param) not in stand_ins:
                    stand_ins[id(param)] = nn.Parameter(_fake_like(param, mode, device), requires_grad=param.requires_grad)
                swapped.append((module, name, param))
                module._parameters[name] = stand_ins[id(param)]
        yield
    finally:
        for module, name, param in reversed(swapped):
            module._parameters[name] = param


def _fake_like(param: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    local = _local(param)
    with mode:
        fake = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device=device)
    return _laid_out_as(fake, param)


@contextlib.contextmanager
def real_stand_ins(module: nn.Module, fqn: str, args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """For the mixing audit of `module` (named `fqn`) on a model with fake parameters: yields the
    call with every fake floating-point input replaced by seeded random values of its shape,
    dtype and device (real inputs, such as positions and masks, kept), and, while inside, the
    fake parameters of `module` and its submodules replaced by seeded random ones. A call
    without fake inputs or parameters passes unchanged."""
    params = [(owner, name, param) for owner in module.modules() for name, param in owner._parameters.items()
              if param is not None and is_fake(param)]
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    if not params and not any(is_fake(leaf) for leaf in leaves):
        yield args, kwargs
        return
    generator = torch.Generator().manual_seed(STAND_IN_SEED)
    real = []
    for leaf in leaves:
        if is_fake(leaf) and not leaf.is_floating_point():
            raise UnsupportedError(f"{fqn}: called with a {leaf.dtype} tensor computed from the parameters, which are "
                                   "on the meta device: the audit for sequence mixing cannot make its values; compile "
                                   "the model with real parameters")
        real.append(_random_like(leaf, generator) if is_fake(leaf) else leaf)
    stand_ins: dict[int, nn.Parameter] = {}
    try:
        for owner, name, param in params:
            if id(param) not in stand_ins:
                value = _random_like(param, generator, STAND_IN_PARAMETER_STD)
                stand_ins[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            owner._parameters[name] = stand_ins[id(param)]
        yield pytree.tree_unflatten(real, spec)
    finally:
        for owner, name, param in params:
            owner._parameters[name] = param


@contextlib.contextmanager
def stand_ins_while_called(model: nn.Module) -> Iterator[None]:
    """For the cut audit (audit/cuts.py) of a model with fake parameters: while inside, each module
    holding fake parameters of its own has them replaced by seeded random ones for the length of
    each of its calls (the same values at every call: the seed is the parameter's place in the
    model), so that no more than one module's parameters are real at a time. A model with real
    parameters passes unchanged."""
    seeds = {id(p): STAND_IN_SEED + i for i, p in enumerate(model.parameters()) if is_fake(p)}
    if not seeds:
        yield
        return
    saved: dict[nn.Module, list] = {}

    def swap_in(module, _args):
        own = [(name, p) for name, p in module._parameters.items() if p is not None and id(p) in seeds]
        saved[module] = own
        for name, param in own:
            generator = torch.Generator().manual_seed(seeds[id(param)])
            module._parameters[name] = nn.Parameter(_random_like(param, generator, STAND_IN_PARAMETER_STD),
                                                    requires_grad=param.requires_grad)

    def swap_back(module, _args, _output):
        for name, param in saved.pop(module, []):
            module._parameters[name] = param

    holders = [m for m in model.modules() if any(p is not None and id(p) in seeds for p in m._parameters.values())]
    handles = [h for m in holders for h in (m.register_forward_pre_hook(swap_in),
                                            m.register_forward_hook(swap_back, always_call=True))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _random_like(tensor: torch.Tensor, generator: torch.Generator, std: float = 1.0) -> torch.Tensor:
    local = _local(tensor)
    values = torch.randn(local.shape, generator=generator, dtype=torch.float32).mul_(std)
    return _laid_out_as(values.to(device=local.device, dtype=local.dtype), tensor)


def _laid_out_as(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` as `like`'s values on this rank: itself, or for a DTensor its local shard."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def refuse_fake_output(fqn: str, output: Any) -> None:
    """A module called with real stand-ins that still returns fake tensors read parameters of
    other modules, which have no values to stand in for."""
    if any(is_fake(leaf) for leaf in pytree.tree_leaves(output)):
        raise UnsupportedError(f"{fqn}: with its own parameters and inputs given values, its output is still computed "
                               "from parameters on the meta device (it reads another module's parameters): the audit "
                               "for sequence mixing cannot run it; compile the model with real parameters")
