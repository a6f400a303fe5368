"""Rewrite every SDPA core of a region with the region's CP method."""
from __future__ import annotations

import torch.fx as fx

from ...context import PassContext
from .all_gather import rewrite_all_gather
from .head_tail import rewrite_head_tail
from .hybrid import rewrite_hybrid
from .match import find_sdpa_cores
from .ulysses import rewrite_ulysses

# method name -> rewrite of one core; each later SDPA method adds one entry.
SDPA_REWRITES = {
    "all_gather": rewrite_all_gather,
    "ulysses": rewrite_ulysses,
    "hybrid": rewrite_hybrid,
    "head_tail": rewrite_head_tail,
}


def sdpa_rewrite_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.method.core != "sdpa":
        return gm
    rewrite = SDPA_REWRITES.get(ctx.method.name)
    if rewrite is None:
        raise NotImplementedError(f"{ctx.fqn}: SDPA method {ctx.method.name!r} has no rewrite")
    for match in find_sdpa_cores(gm):
        rewrite(gm, match, ctx)
    # Rewrites read K/V before HF's repeat_kv; the repeated copies would otherwise still be made.
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
