"""Regions whose local compute a user's `local_compute_fn` takes over (methods/local_compute.py).

The region is traced through the user's function, called as `fn(module, *call args, cp=mesh,
**call kwargs)`: whatever collectives it issues through `cpcompile.primitives` become graph
nodes (the dump lists them; `passes/local_compute.py` checks them against the declaration). A
call that does not fit the function's signature is refused before the region is traced.
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ..errors import CPInputError
from ..methods import AdapterSpec, register_adapter
from ..methods.local_compute import LOCAL_CORE, lookup
from .sdpa import CACHE_KWARGS


class LocalComputeRegion:
    def __init__(self, method):
        self.declared = lookup(method)
        self.mesh = None

    def bind(self, target, mesh) -> None:
        """The region it installs for and the mesh its function receives as `cp`."""
        self.mesh = mesh
        self.fqn, self.module = target.fqn, target.module

    def prepare_call(self, fqn: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if any(kwargs.get(name) is not None for name in CACHE_KWARGS):
            raise CPInputError(f"{fqn}: called with an inference cache; CP regions are for training (use_cache=False)")
        try:
            inspect.signature(self.declared.fn).bind(self.module, *args, cp=self.mesh, **kwargs)
        except TypeError as exc:
            given = ", ".join([f"arg{i}" for i in range(len(args))] + list(kwargs))
            raise CPInputError(
                f"{fqn}: local_compute_fn {self.declared.path} does not fit the region's call (module, {given}, cp=...): "
                f"{exc}; it must take the module, then the region's arguments, and the keyword `cp`"
            ) from exc
        return args, kwargs

    def forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.declared.fn(module, *args, cp=self.mesh, **kwargs)


register_adapter(AdapterSpec("local_compute", core=LOCAL_CORE, region=LocalComputeRegion))
