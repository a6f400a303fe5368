"""A rewritten region and how it is called in place of the module's forward."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from .capture import PREFIX


def signature_key(args: tuple, kwargs: dict) -> tuple:
    """What a traced graph is specialised on: structure, tensor metadata, other values."""
    leaves, spec = pytree.tree_flatten((args, kwargs))

    def describe(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
        return (type(leaf).__name__, leaf if isinstance(leaf, (int, float, bool, str, type(None))) else id(leaf))

    return (spec, tuple(describe(leaf) for leaf in leaves))


@dataclass
class RegionProgram:
    """A rewritten graph plus what it takes to call it with the live module's state.

    `state` lists, for each leading placeholder, where its value lives at call time
    (("param" | "buffer", name) or ("constant", tensor)), so parameters are read from the
    module on every call — a later FSDP2 `fully_shard` swapping them still works.
    """

    gm: fx.GraphModule
    state: list[tuple[str, Any]]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec

    @classmethod
    def from_export(cls, ep: torch.export.ExportedProgram, gm: fx.GraphModule) -> "RegionProgram":
        state = []
        for spec in ep.graph_signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                continue
            name = spec.target[len(PREFIX):] if spec.target and spec.target.startswith(PREFIX) else spec.target
            if spec.kind == InputKind.PARAMETER:
                state.append(("param", name))
            elif spec.kind == InputKind.BUFFER:
                state.append(("buffer", name))
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                state.append(("constant", ep.constants[spec.target]))
            else:
                raise NotImplementedError(f"unsupported exported input kind {spec.kind}")
        return cls(gm, state, ep.call_spec.in_spec, ep.call_spec.out_spec)

    def flat_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> list[Any]:
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise RuntimeError(f"region called with input structure {spec}, traced with {self.in_spec}")
        return [self._state_value(module, kind, ref) for kind, ref in self.state] + leaves

    @staticmethod
    def _state_value(module: nn.Module, kind: str, ref: Any) -> Any:
        if kind == "param":
            return module.get_parameter(ref)
        if kind == "buffer":
            return module.get_buffer(ref)
        return ref

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        out = self.gm(*self.flat_inputs(module, args, kwargs))
        return pytree.tree_unflatten(out, self.out_spec)


RegionBuilder = Callable[[tuple, dict], RegionProgram]
