"""A plan override's `inner_wrapper`, resolved to the `CPMethod` its wrapper returns: a registered
short name (`names.py`), a `{_target_: dotted.path, **params}` mapping whose target lies in an
allowed module and carries the `@inner_wrapper` marker, or (from a dict or Python plan) the marked
callable itself, then called with its parameters. Every refusal is a `PlanError` naming the field.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from ..errors import PlanError, short_repr
from . import names as wrapper_names
from .method import CPMethod

TARGET_KEY = "_target_"


def resolve_inner_wrapper(path: str, spec: Any) -> CPMethod:
    """Turn an `inner_wrapper` value into the CPMethod its (marked) wrapper returns."""
    if isinstance(spec, str):
        return _call_wrapper(path, spec, _lookup_name(path, spec), {})
    if isinstance(spec, Mapping):
        if TARGET_KEY not in spec:
            raise PlanError(f"{path}.{TARGET_KEY}", "is required when inner_wrapper is a mapping")
        target = spec[TARGET_KEY]
        params = {k: v for k, v in spec.items() if k != TARGET_KEY}
        for key in params:
            if not isinstance(key, str):
                raise PlanError(path, f"parameter names must be strings, got {short_repr(key)}")
        if isinstance(target, str):
            try:
                fn = wrapper_names.import_marked_target(target)
            except ValueError as exc:
                raise PlanError(f"{path}.{TARGET_KEY}", str(exc)) from exc
            return _call_wrapper(path, target, fn, params)
        if callable(target):
            return _call_wrapper(path, _callable_name(target), _check_marked(f"{path}.{TARGET_KEY}", target), params)
        raise PlanError(f"{path}.{TARGET_KEY}", f"must be a dotted path string, got {type(target).__name__}")
    if callable(spec):  # a dict or Python plan may hand over the wrapper object itself
        return _call_wrapper(path, _callable_name(spec), _check_marked(path, spec), {})
    raise PlanError(
        path,
        f"must be a registered name, a mapping with {TARGET_KEY}, or a marked callable; "
        f"got {type(spec).__name__}",
    )


def _lookup_name(path: str, name: str) -> Callable:
    names = wrapper_names.registered_names()
    if name not in names:
        hint = f"; for a dotted path write {{{TARGET_KEY}: {name}}}" if "." in name else ""
        raise PlanError(path, f"unknown inner wrapper {short_repr(name)}; registered names: {', '.join(names)}{hint}")
    try:
        return wrapper_names.lookup_registered(name)
    except ValueError as exc:
        raise PlanError(path, f"registered wrapper {short_repr(name)} cannot be loaded: {exc}") from exc


def _check_marked(path: str, fn: Any) -> Callable:
    if not wrapper_names.is_inner_wrapper(fn):
        raise PlanError(
            path,
            f"{_callable_name(fn)} is not marked with @cpcompile.inner_wrapper; "
            "plans may only call marked inner wrappers",
        )
    return fn


def _call_wrapper(path: str, label: str, fn: Callable, params: dict[str, Any]) -> CPMethod:
    try:
        inspect.signature(fn).bind(**params)
    except TypeError as exc:
        raise PlanError(path, f"bad parameters for inner wrapper {label}: {exc}") from exc
    except ValueError:  # no introspectable signature (some builtins): let the call decide
        pass
    try:
        method = fn(**params)
    except (TypeError, ValueError) as exc:
        given = ", ".join(f"{k}={short_repr(v)}" for k, v in params.items()) or "no parameters"
        raise PlanError(path, f"inner wrapper {label} rejected its parameters ({given}): {exc}") from exc
    if not isinstance(method, CPMethod):
        raise PlanError(
            path, f"inner wrapper {label} returned {type(method).__name__}, expected a CPMethod"
        )
    return method


def _callable_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}" if module else name
