"""`torch.compile` around CP regions: each new input signature runs eagerly once, then compiled
as one graph with the regions inside.

A rewritten region (`installed_region.InstalledRegion`) looks its graph up by the call's signature and
traces one on a signature it has not met: `torch.export`, the passes and, for a signature new to
the cp group, one agreement gather. Dynamo can trace the lookup and inline the graph it finds into
the caller's graph (collectives and custom ops included), so a layer holding regions compiles as
one graph, its activation checkpoint too. It cannot trace the export: there it breaks the graph,
and a break inside a checkpoint makes Dynamo run the whole checkpointed layer eagerly under
guards that the region's new graph does not touch, so that layer would stay eager for that
signature for good. Worse, a signature may be new on one rank only (transformers passes a padding
mask to the ranks whose shard has padding, and builds one for every rank when compiled): that
rank's graph breaks where the others' does not, and ranks whose compiled backward graphs differ
may issue their gradient collectives in different orders, and wait on each other for good.

So regions inline only inside `compile_around_regions(fn)`, which runs the first call of each
input signature of `fn` eagerly (the regions trace then, on every rank alike) and every later
call compiled, when every region finds its graph. Anywhere else under `torch.compile` a region
is a graph of its own, on every rank (`InstalledRegion` logs that once). Static shapes: a
region keeps one graph per shape anyway, and symbolic sizes cannot key its lookup.

Dynamo keeps its compiled code per code object, and every decoder layer's forward is the same
code. The layers of one kind share one entry, regions included: a region is a bound method in the
module's `forward` (an object there would be guarded on its identity) and alike regions run one
graph object (`region.shared_runnable`). Each new input signature or kind adds entries, and past
`recompile_limit` entries (8 by default) Dynamo runs the code eagerly with only a warning (before
the layers shared their entry, a 20-layer CP model compiled 8 layers). So each function compiled
here, and each region (where it is a graph of its own, its `_run` is one code object too), brings
Dynamo's default share of entries to the limit (`add_code_entry`, `room_for_every_entry`).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from .region import autocast_state, call_structure, leaf_key


DYNAMO_ENTRIES_PER_FUNCTION = 8  # torch._dynamo.config.recompile_limit's default
_inlining = False  # set while `EagerFirstCompiled` runs its compiled function (Dynamo guards on it)
_code_entries = 0  # compiled functions and regions made: each may be an entry of a code object they share


def regions_inlined() -> bool:
    """Whether code being compiled now may inline the CP regions it calls."""
    return _inlining


def add_code_entry() -> None:
    """Count one more compiled function or region (the module docstring says why)."""
    global _code_entries
    _code_entries += 1


@contextlib.contextmanager
def room_for_every_entry() -> Iterator[None]:
    """Dynamo's recompile limits raised to its default share for each counted function or region;
    never lowered."""
    config = torch._dynamo.config
    per_code = max(config.recompile_limit, DYNAMO_ENTRIES_PER_FUNCTION * _code_entries)
    with config.patch(recompile_limit=per_code,
                      accumulated_recompile_limit=max(config.accumulated_recompile_limit, per_code)):
        yield


@contextlib.contextmanager
def inlining_regions() -> Iterator[None]:
    global _inlining
    before, _inlining = _inlining, True
    try:
        yield
    finally:
        _inlining = before


def call_signature(args: tuple, kwargs: dict) -> tuple:
    """What the regions a call reaches are traced for, as a region's own key says it
    (`region.flatten_call`), with any other leaf (a cache object) keyed by its type."""
    call = (tuple(args), dict(kwargs))
    leaves = pytree.tree_leaves(call)
    described = tuple(leaf_key(leaf) or ("object", type(leaf)) for leaf in leaves)
    return call_structure(call), described, autocast_state(leaves)


class EagerFirstCompiled:
    """`fn` compiled, but called eagerly the first time each call signature comes."""

    def __init__(self, fn: Callable, **compile_options: Any):
        self.eager = fn
        self.compiled = torch.compile(fn, dynamic=False, **compile_options)
        self.seen: set[tuple] = set()
        functools.update_wrapper(self, fn)
        add_code_entry()

    def __call__(self, *args, **kwargs):
        signature = call_signature(args, kwargs)
        if signature in self.seen:
            with inlining_regions(), room_for_every_entry():
                return self.compiled(*args, **kwargs)
        self.seen.add(signature)
        return self.eager(*args, **kwargs)


def compile_around_regions(fn: Callable, backend: Any = "inductor", **options: Any) -> EagerFirstCompiled:
    """`torch.compile(fn, backend=backend, dynamic=False, **options)` for code that calls CP regions,
    each new call signature run eagerly once first (the module docstring says why)."""
    return EagerFirstCompiled(fn, backend=backend, **options)
