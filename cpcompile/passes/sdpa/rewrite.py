"""Rewrite every SDPA core of a region with the region's CP method."""
from __future__ import annotations

import torch.fx as fx

from ...context import PassContext
from ...methods import method_spec
from .match import CORE


def sdpa_rewrite_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.method.core != CORE:
        return gm
    spec = method_spec(ctx.method)  # each method registers its rewrite in its own file
    for match in spec.find(gm):
        spec.rewrite(gm, match, ctx)
    # Rewrites read K/V before HF's repeat_kv; the repeated copies would otherwise still be made.
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
