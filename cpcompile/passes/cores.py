"""Find a region's cores once, then rewrite each with the region's method, whatever the core kind.

The SDPA, GDN and `local_compute_fn` rewrites are one loop: `find_cores_pass` runs the method's
finder (`MethodSpec.find`) and keeps its matches in `ctx.cores`; `rewrite_cores_pass` gives each
match the step every method of its kind takes first (`MethodSpec.prepare`: GDN's conv halo), then
the method's own rewrite (`MethodSpec.rewrite`), and counts it: the one place that counts rewritten
cores (`verify_pass` refuses a region with none).
"""
from __future__ import annotations

import torch.fx as fx

from ..context import PassContext
from ..errors import CoverageError
from ..methods import method_spec


def find_cores_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The region holds the core its method rewrites: its matches, kept for `rewrite_cores_pass`.
    Only `local_length_pass` runs in between, and it replaces `arange` nodes, never a core or an
    input of one."""
    ctx.cores = method_spec(ctx.method).find(gm)
    if not ctx.cores:
        raise CoverageError(
            f"{ctx.fqn}: the plan selects {ctx.method.describe()} but the traced module has no "
            f"{ctx.method.core} core (for SDPA: is the model using attn_implementation='sdpa'?)"
        )
    return gm


def rewrite_cores_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    spec = method_spec(ctx.method)  # each method registers its rewrite in its own file
    for match in ctx.cores:
        if spec.prepare is not None:
            spec.prepare(gm, match, ctx)
        spec.rewrite(gm, match, ctx)
        ctx.cores_rewritten += 1
    if spec.drop_dead_code:
        gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
