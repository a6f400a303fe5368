"""The `@inner_wrapper` marker and the short wrapper names usable in a plan (part of the method registry).

A plan may name a wrapper by a registered short name (`sdpa_hf`) or by `_target_`, a dotted
path. A YAML file is data, so naming a module must not run its code: a `_target_` is resolved only
when it is the path of a registered name, or lies in an allowed module — cpcompile's own wrapper
modules (`BUILTIN_WRAPPER_MODULES`) and those a program allowed with `allow_wrapper_module`.
Anything else is refused before any import. What is imported must then carry the marker, so a
plan can never make cpcompile call an arbitrary function either.
"""
from __future__ import annotations

import importlib
from typing import Callable

from ..errors import CPInputError, short_repr

_MARKER = "__cpcompile_inner_wrapper__"

# short name -> dotted path of a marked wrapper (imported lazily, on first use)
_REGISTERED: dict[str, str] = {
    "sdpa_hf": "cpcompile.wrappers.sdpa_hf_cp_wrapper",
    "sdpa_qkv": "cpcompile.wrappers.sdpa_qkv_cp_wrapper",
    "sdpa_hf_ulysses": "cpcompile.wrappers.sdpa_hf_ulysses_cp_wrapper",
    "sdpa_qkv_ulysses": "cpcompile.wrappers.sdpa_qkv_ulysses_cp_wrapper",
}

# Modules (with their submodules) a `_target_` may name. `cpcompile.models` is the former home
# of the Qwen3.5 GDN wrappers, kept as an alias.
BUILTIN_WRAPPER_MODULES = ("cpcompile.wrappers", "cpcompile.adapters", "cpcompile.models")
_ALLOWED_MODULES: list[str] = list(BUILTIN_WRAPPER_MODULES)


def inner_wrapper(fn: Callable) -> Callable:
    """Mark `fn` as a CP inner wrapper: a factory returning a `CPMethod`."""
    setattr(fn, _MARKER, True)
    return fn


def is_inner_wrapper(obj: object) -> bool:
    return callable(obj) and getattr(obj, _MARKER, False) is True


def register_inner_wrapper(name: str, dotted_path: str) -> None:
    """Make `name` usable as `inner_wrapper: <name>` in a plan, and `dotted_path` as its `_target_`."""
    _check_dotted(dotted_path, "dotted_path")
    if name in _REGISTERED and _REGISTERED[name] != dotted_path:
        raise CPInputError(f"inner wrapper name {name!r} is already registered to {_REGISTERED[name]}")
    _REGISTERED[name] = dotted_path


def allow_wrapper_module(module: str) -> None:
    """Let plans name wrappers by `_target_` in `module` and its submodules (e.g. "mypkg.cp").

    Call it from the program that loads the plan, before loading it: a YAML file cannot allow
    a module itself, so no module is imported only because a plan named it.
    """
    _check_dotted(module, "module")
    if module not in _ALLOWED_MODULES:
        _ALLOWED_MODULES.append(module)


def allowed_modules() -> list[str]:
    return list(_ALLOWED_MODULES)


def registered_names() -> list[str]:
    return sorted(_REGISTERED)


def lookup_registered(name: str) -> Callable | None:
    path = _REGISTERED.get(name)
    return None if path is None else import_marked_target(path)


def import_marked_target(dotted_path: str) -> Callable:
    """Import `pkg.mod.attr` if a registered name or an allowed module covers it; refuse
    anything that is not a marked inner wrapper. Nothing is imported for a refused path."""
    module_path, _, attr = dotted_path.rpartition(".")
    if not module_path or not _is_dotted(dotted_path):
        raise CPInputError(f"{short_repr(dotted_path)} is not a dotted path of the form package.module.function")
    if dotted_path not in _REGISTERED.values() and not _is_allowed(module_path):
        raise CPInputError(
            f"module {short_repr(module_path)} may not provide inner wrappers, so it was not imported; plans may "
            f"name wrappers in {', '.join(_ALLOWED_MODULES)}; for your own, call "
            f"cpcompile.allow_wrapper_module({short_repr(module_path)}) or "
            "cpcompile.register_inner_wrapper(name, path) before loading the plan"
        )
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise CPInputError(f"cannot import module {short_repr(module_path)}: {exc}") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise CPInputError(f"module {short_repr(module_path)} has no attribute {short_repr(attr)}")
    if not is_inner_wrapper(target):
        raise CPInputError(
            f"{short_repr(dotted_path)} is not marked with @cpcompile.inner_wrapper; "
            "plans may only call marked inner wrappers"
        )
    return target


def _is_allowed(module_path: str) -> bool:
    return any(module_path == allowed or module_path.startswith(allowed + ".") for allowed in _ALLOWED_MODULES)


def _is_dotted(text: object) -> bool:
    return isinstance(text, str) and all(part.isidentifier() for part in text.split("."))


def _check_dotted(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a dotted module path string, got {type(value).__name__}")
    if not _is_dotted(value):
        raise CPInputError(f"{what} must be a dotted path of identifiers like 'mypkg.cp', got {short_repr(value)}")
