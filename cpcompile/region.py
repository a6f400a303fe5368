"""A rewritten region and how it is called in place of the module's forward."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from .capture import PREFIX
from .errors import UnsupportedError

# Non-tensor call arguments a traced graph may be specialised on (by value).
PLAIN_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device)


def flatten_call(fqn: str, args: tuple, kwargs: dict) -> tuple[list[Any], tuple]:
    """The call's leaves, and the key a traced graph is specialised on: the structure, each
    tensor's shape/dtype/device, each other leaf's value and the autocast state. Anything else cannot be keyed
    reliably, so it is refused rather than traced again on every call."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    described = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device))
        elif isinstance(leaf, PLAIN_VALUES):
            described.append((type(leaf).__name__, leaf))
        else:
            raise TypeError(f"{fqn}: a CP region cannot take an argument of type {type(leaf).__name__}; "
                            "pass tensors and plain values (int, float, bool, str, None)")
    return leaves, (spec, tuple(described), autocast_state(leaves))


def autocast_state(leaves: list[Any]) -> tuple:
    """Whether autocast is on, and to which dtype, for each device type the call's tensors are on.

    A traced graph holds the dtypes it was traced with (it checks them as it runs), so a call
    under autocast must not run a graph traced outside it, nor the reverse: the state is part of
    the signature, and a call under a new state traces the region again, under that state."""
    devices = sorted({leaf.device.type for leaf in leaves if isinstance(leaf, torch.Tensor)})
    return tuple((d, torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None) for d in devices)


@dataclass
class RegionProgram:
    """A rewritten graph plus what it takes to call it with the live module's state.

    `state` lists, for each leading placeholder, where its value lives at call time: an
    (owning submodule, attribute name) pair read on every call — so a later FSDP2
    `fully_shard`, which swaps parameters on their modules, still works — or a constant.
    """

    gm: fx.GraphModule
    state: list[tuple[nn.Module, str] | torch.Tensor]
    out_spec: pytree.TreeSpec

    @classmethod
    def from_export(cls, ep: torch.export.ExportedProgram, module: nn.Module) -> "RegionProgram":
        state = []
        for spec in ep.graph_signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                continue
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                owner, _, attr = spec.target[len(PREFIX):].rpartition(".")
                state.append((module.get_submodule(owner), attr))
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                state.append(ep.constants[spec.target])
            else:
                raise UnsupportedError(f"unsupported exported input kind {spec.kind}")
        return cls(ep.graph_module, state, ep.call_spec.out_spec)

    def flat_inputs(self, leaves: list[Any]) -> list[Any]:
        live = [getattr(*ref) if isinstance(ref, tuple) else ref for ref in self.state]
        return live + list(leaves)

    def __call__(self, leaves: list[Any]) -> Any:
        return pytree.tree_unflatten(self.gm(*self.flat_inputs(leaves)), self.out_spec)
