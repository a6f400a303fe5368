"""The collective ops that rewrite passes put into graphs, kept in one place.

Passes emit *visible* functional collectives: a launch node (an op from the
`_c10d_functional_autograd` namespace, which carries its own backward: all-gather ↔
reduce-scatter, all-to-all ↔ inverse all-to-all) followed by a `wait_tensor` node. The
autograd entry points moved between torch releases (2.13 gave the plain `_c10d_functional`
ops autograd and kept these as compatibility names); the `_c10d_functional_autograd`
names exist in every release we support (torch>=2.11), so only this module names them.
"""
from __future__ import annotations

import torch

_funcol_autograd = torch.ops._c10d_functional_autograd
_funcol = torch.ops._c10d_functional

ALL_GATHER = _funcol_autograd.all_gather_into_tensor.default
ALL_TO_ALL = _funcol_autograd.all_to_all_single.default
REDUCE_SCATTER = _funcol_autograd.reduce_scatter_tensor.default
WAIT = _funcol.wait_tensor.default

LAUNCH_OPS = frozenset({ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER})

# Collective ops as they may appear after tracing / AOT autograd (backward graphs use the
# non-autograd names). Used by structure checks and the dump, never for emitting.
_KNOWN_LAUNCH_NAMES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_reduce",
)


def is_launch(target: object) -> bool:
    """True for a functional-collective launch op, autograd or not."""
    name = getattr(target, "__name__", "") or ""
    namespace = getattr(target, "namespace", "") or ""
    return namespace in ("_c10d_functional", "_c10d_functional_autograd") and any(
        name.startswith(known) for known in _KNOWN_LAUNCH_NAMES
    )


def is_wait(target: object) -> bool:
    return getattr(target, "namespace", "") == "_c10d_functional" and (
        getattr(target, "__name__", "") or ""
    ).startswith("wait_tensor")


def collective_kind(target: object) -> str:
    """Short name of a launch op: 'all_gather_into_tensor', 'all_to_all_single', …"""
    name = getattr(target, "__name__", "")
    return name.split(".")[0]
