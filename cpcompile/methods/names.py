"""The `@inner_wrapper` marker and the short wrapper names usable in a plan (part of the method registry).

A plan may name a wrapper by a registered short name (`sdpa_hf`) or by `_target_`, a dotted
path. A dotted path is only accepted when it resolves to a callable carrying the marker, so a
YAML file can never make cpcompile call an arbitrary function.
"""
from __future__ import annotations

import importlib
from typing import Callable

from ..errors import CPInputError

_MARKER = "__cpcompile_inner_wrapper__"

# short name -> dotted path of a marked wrapper (imported lazily, on first use)
_REGISTERED: dict[str, str] = {
    "sdpa_hf": "cpcompile.wrappers.sdpa_hf_cp_wrapper",
    "sdpa_qkv": "cpcompile.wrappers.sdpa_qkv_cp_wrapper",
    "sdpa_hf_ulysses": "cpcompile.wrappers.sdpa_hf_ulysses_cp_wrapper",
    "sdpa_qkv_ulysses": "cpcompile.wrappers.sdpa_qkv_ulysses_cp_wrapper",
}


def inner_wrapper(fn: Callable) -> Callable:
    """Mark `fn` as a CP inner wrapper: a factory returning a `CPMethod`."""
    setattr(fn, _MARKER, True)
    return fn


def is_inner_wrapper(obj: object) -> bool:
    return callable(obj) and getattr(obj, _MARKER, False) is True


def register_inner_wrapper(name: str, dotted_path: str) -> None:
    """Make `name` usable as `inner_wrapper: <name>` in a plan."""
    if name in _REGISTERED and _REGISTERED[name] != dotted_path:
        raise CPInputError(f"inner wrapper name {name!r} is already registered to {_REGISTERED[name]}")
    _REGISTERED[name] = dotted_path


def registered_names() -> list[str]:
    return sorted(_REGISTERED)


def lookup_registered(name: str) -> Callable | None:
    path = _REGISTERED.get(name)
    return None if path is None else import_marked_target(path)


def import_marked_target(dotted_path: str) -> Callable:
    """Import `pkg.mod.attr`; refuse anything that is not a marked inner wrapper."""
    module_path, _, attr = dotted_path.rpartition(".")
    if not module_path:
        raise CPInputError(f"{dotted_path!r} is not a dotted path of the form package.module.function")
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise CPInputError(f"cannot import module {module_path!r}: {exc}") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise CPInputError(f"module {module_path!r} has no attribute {attr!r}")
    if not is_inner_wrapper(target):
        raise CPInputError(
            f"{dotted_path!r} is not marked with @cpcompile.inner_wrapper; "
            "plans may only call marked inner wrappers"
        )
    return target
