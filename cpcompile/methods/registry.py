"""The one registry of CP methods and model adapters.

A method registers itself once, in its own pass file (`passes/sdpa/<method>.py`,
`passes/gdn/<method>.py`), with a `MethodSpec`: the core kind it rewrites, its name, the finder of
those cores and the rewrite of one core, the sequence layout it needs, the sub-groups to build
before any trace, and — for an async method — its sync counterpart. A model adapter
(`adapters/<model>.py`) registers an `AdapterSpec`: how a region is called and traced, and which
modules are cores by type. Everything downstream asks here, never a name string:

- `compile` (pipeline.py): `region_for` (the adapter of a region), `method_spec(...).subgroups`;
- capture: `core_module_kind` (cores recognised by module type);
- the passes: `method_spec(...).find` / `.prepare` / `.rewrite` (`passes/cores.py`); the schedule pass: `.sync_wrapper`;
- the plan's layout rule: `methods_of_core` (does a core have a method for a layout?).

Wrappers (`cpcompile.wrappers`, `adapters/qwen3_5.py`) make their `CPMethod` with
`spec.cp_method(wrapper_name, **params)`; the registry finds the spec again by
(core, name, asynchronous). cpcompile's own methods and adapters are registered by
`cpcompile/builtin_methods.py`, which the package imports; this module imports none of them
(a plan's own wrappers register their methods the same way, when their module is imported).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import CPInputError, UnsupportedError
from .method import CONTIGUOUS, CPMethod


def no_subgroups(params: Mapping[str, Any]) -> tuple[int, ...]:
    return ()


@dataclass(frozen=True)
class MethodSpec:
    """Everything cpcompile knows about one CP method.

    `find(gm)` returns the region's cores of kind `core` as matches (each `replace_with`s its
    core); `rewrite(gm, match, ctx)` rewrites one. `adapter` names the region adapter used when
    the wrapper's `CPMethod` names none (its `adapter` parameter). `passes/cores.py` runs them:
    `prepare(gm, match, ctx)`, when set, before each `rewrite`. `subgroups(params)` gives the
    Ulysses degrees whose (Ulysses, ring) sub-groups `compile` builds on every rank before any
    trace (creating groups is collective, so a pass may only look them up). An asynchronous
    method names `sync_wrapper`, the wrapper of the same method without the schedule.
    """

    core: str
    name: str
    find: Callable
    rewrite: Callable
    layout: str = CONTIGUOUS
    adapter: str | None = None
    subgroups: Callable[[Mapping[str, Any]], tuple[int, ...]] = no_subgroups
    asynchronous: bool = False
    sync_wrapper: str | None = None
    fixed_chunks: bool = False  # `CPMethod.fixed_chunks`
    # what every method of the core does to a core before its own rewrite (GDN: the conv halo)
    prepare: Callable | None = None
    drop_dead_code: bool = False  # after the rewrites (SDPA: the K/V copies of HF's repeat_kv)

    @property
    def key(self) -> tuple[str, str, bool]:
        return (self.core, self.name, self.asynchronous)

    def label(self) -> str:
        return f"{self.core}:{self.name}" + (" async" if self.asynchronous else "")

    def cp_method(self, wrapper: str, **params: Any) -> CPMethod:
        """The `CPMethod` a wrapper named `wrapper` returns for this method, with its parameters."""
        return CPMethod(name=self.name, core=self.core, wrapper=wrapper, layout=self.layout, params=params,
                        asynchronous=self.asynchronous, fixed_chunks=self.fixed_chunks)

    def async_variant(self, sync_wrapper: str) -> "MethodSpec":
        """The same method with its collectives scheduled for overlap (`schedule_pass`)."""
        return dataclasses.replace(self, asynchronous=True, sync_wrapper=sync_wrapper)


@dataclass(frozen=True)
class AdapterSpec:
    """A model adapter. `region(method)` returns the object that prepares a region's calls
    (`prepare_call(fqn, args, kwargs)`), names the forward to trace (`forward(module, ...)`) and,
    optionally, reads what the region's modules declare about their attention
    (`declared_attention(fqn, module)` -> `context.DeclaredAttention`: causality, sliding window);
    `is_core_module(module)` recognises cores that are modules (GDN layers) rather than op calls."""

    name: str
    core: str
    region: Callable[[CPMethod], Any]
    is_core_module: Callable[[Any], bool] | None = None


_METHODS: dict[tuple[str, str, bool], MethodSpec] = {}
_ADAPTERS: dict[str, AdapterSpec] = {}


def _register(table: dict, key, spec, what: str):
    """Add `spec` under `key` once; the same spec again is harmless, another one is refused."""
    if table.get(key, spec) != spec:
        raise CPInputError(f"{what} is already registered")
    table[key] = spec
    return spec


def register_method(spec: MethodSpec) -> MethodSpec:
    """Register `spec` once; returns it, so a pass file can keep it as a constant for its wrappers."""
    return _register(_METHODS, spec.key, spec, f"CP method {spec.label()}")


def register_adapter(spec: AdapterSpec) -> AdapterSpec:
    return _register(_ADAPTERS, spec.name, spec, f"model adapter {spec.name!r}")


def method_spec(method: CPMethod) -> MethodSpec:
    """The registered spec of the method a wrapper returned."""
    spec = _METHODS.get((method.core, method.name, method.asynchronous))
    if spec is None:
        known = ", ".join(sorted(s.label() for s in _METHODS.values()))
        raise UnsupportedError(f"no CP method is registered for {method.describe()}; registered: {known}")
    return spec


def methods_of_core(core: str) -> list[MethodSpec]:
    return [spec for spec in _METHODS.values() if spec.core == core]


def region_for(method: CPMethod):
    """The object that prepares calls of, and traces, a region rewritten by `method`."""
    name = method.params.get("adapter", method_spec(method).adapter)
    adapter = _ADAPTERS.get(name)
    if adapter is None:
        raise UnsupportedError(f"no region adapter for {method.describe()}")
    return adapter.region(method)


def core_module_kind(module: Any) -> str | None:
    """The core kind a module *is* (cores found by module type rather than by an op call)."""
    for adapter in _ADAPTERS.values():
        if adapter.is_core_module is not None and adapter.is_core_module(module):
            return adapter.core
    return None
