"""`local_compute_fn`: the user takes over a region's local compute (trainer RFC §3.4).

A plan override names `local_compute_fn` instead of `inner_wrapper` (never both): a registered
function that replaces the region's forward, with its own collectives, written with the public
CP primitives (`cpcompile.primitives`). Registration is the decorator, so a plan names only
functions a program has imported and marked — a YAML file never imports a module:

    @cpcompile.local_compute_fn                   # registers "mypkg.attn.cp_attention"
    def cp_attention(module, q, k, v, *, cp):     # the region's call, plus `cp`: the CPMesh
        k, v = all_gather_sequence(k, cp, seq_dim=2), all_gather_sequence(v, cp, seq_dim=2)
        ...

    plan_overrides: [{match: "*.core", when: cp, region_dispatch: false,
                      local_compute_fn: mypkg.attn.cp_attention}]    # or {_target_: ..., asynchronous: true}

`@cpcompile.local_compute_fn(collectives=False)` declares a function without collectives: only
such a function may have `region_dispatch: true`. Resolved, the override holds a `CPMethod` of
the `local` core (`name` "local_compute", `wrapper` the function's path), so compile installs it
as any rewritten region; `passes/local_compute.py` registers its spec.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import short_repr
from .method import CPMethod

LOCAL_CORE = "local"
LOCAL_COMPUTE = "local_compute"
PARAMS = ("asynchronous",)


@dataclass(frozen=True)
class LocalComputeFn:
    """A registered local compute function and what it declares."""

    path: str
    fn: Callable
    collectives: bool


_REGISTERED: dict[str, LocalComputeFn] = {}


def local_compute_fn(fn: Callable | None = None, *, collectives: bool = True):
    """Register `fn` as a local compute function a plan may name by its dotted path
    (`module.qualname`). `collectives=False` declares that it communicates with no other rank."""
    if fn is None:
        return lambda f: local_compute_fn(f, collectives=collectives)
    if not callable(fn):
        raise TypeError(f"@local_compute_fn decorates a function, got {type(fn).__name__}")
    path = f"{fn.__module__}.{fn.__qualname__}"
    _REGISTERED[path] = LocalComputeFn(path, fn, collectives)  # a re-imported module registers again
    return fn


def registered_local_compute(spec: Any) -> tuple[LocalComputeFn, dict[str, Any]]:
    """The registered function a plan's `local_compute_fn` value names, and its parameters.

    `spec` is a dotted path, a mapping `{_target_: path, asynchronous: bool}`, or (from a Python
    plan) the decorated function itself. Raises `ValueError` (a PlanError for the caller) naming
    what is wrong; nothing is imported."""
    params: dict[str, Any] = {}
    if isinstance(spec, Mapping):
        if "_target_" not in spec:
            raise ValueError("a mapping needs _target_ (the function's dotted path)")
        params = {k: v for k, v in spec.items() if k != "_target_"}
        unknown = [k for k in params if k not in PARAMS]
        if unknown:
            raise ValueError(f"unknown parameter {short_repr(unknown[0])}; local_compute_fn takes {', '.join(PARAMS)}")
        if not isinstance(params.get("asynchronous", False), bool):
            raise ValueError(f"asynchronous must be true or false, got {short_repr(params['asynchronous'])}")
        spec = spec["_target_"]
    if callable(spec):
        spec = f"{spec.__module__}.{spec.__qualname__}"
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"must be a dotted path string, got {short_repr(spec)}")
    found = _REGISTERED.get(spec)
    if found is None:
        raise ValueError(
            f"{short_repr(spec)} is not a registered local compute function; decorate it with "
            "@cpcompile.local_compute_fn and import its module before loading the plan (a plan imports nothing)"
        )
    return found, params


def local_compute_method(found: LocalComputeFn, params: Mapping[str, Any]) -> CPMethod:
    return CPMethod(name=LOCAL_COMPUTE, core=LOCAL_CORE, wrapper=found.path,
                    asynchronous=bool(params.get("asynchronous", False)))


def lookup(method: CPMethod) -> LocalComputeFn:
    return _REGISTERED[method.wrapper]
