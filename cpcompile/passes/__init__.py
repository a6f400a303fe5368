"""The rewrite pipeline for one captured region.

Passes are plain functions `name_pass(gm, ctx) -> gm`, run in this order:

1. `find_cores_pass`   — the region holds the core kind its method rewrites (checks.py)
2. `sdpa_rewrite_pass` — SDPA cores → collectives + local attention (sdpa_rewrite.py)
3. `schedule_pass`     — async methods: launches early, waits late (not implemented yet)
4. `verify_pass`       — lint, launch/wait pairing, fake values (checks.py)

Each pass keeps `meta["val"]` valid; the orchestrator dumps the graph before and after
each pass when a dump is requested.
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from ..context import PassContext
from .checks import find_cores_pass, verify_pass
from .sdpa_rewrite import sdpa_rewrite_pass

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]



def schedule_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.method.asynchronous:
        raise NotImplementedError(f"{ctx.fqn}: asynchronous CP methods are not implemented yet ({ctx.method.wrapper})")
    return gm


PIPELINE: tuple[Pass, ...] = (find_cores_pass, sdpa_rewrite_pass, schedule_pass, verify_pass)


def run_passes(gm: fx.GraphModule, ctx: PassContext, on_pass=None) -> fx.GraphModule:
    """Run PIPELINE; `on_pass(name, code_before, code_after)` observes each step."""
    for step in PIPELINE:
        before = gm.code if on_pass else ""
        gm = step(gm, ctx)
        if on_pass:
            on_pass(step.__name__, before, gm.code)
    return gm
