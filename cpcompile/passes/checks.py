"""The first and last passes: the region holds the core its method expects; the result is sound."""
from __future__ import annotations

import torch.fx as fx

from .. import collectives as C
from ..context import PassContext
from ..errors import CoverageError
from ..methods import method_spec


def find_cores_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not method_spec(ctx.method).find(gm):
        raise CoverageError(
            f"{ctx.fqn}: the plan selects {ctx.method.describe()} but the traced module has no "
            f"{ctx.method.core} core (for SDPA: is the model using attn_implementation='sdpa'?)"
        )
    return gm


def verify_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Lint, every launch is waited exactly once, and every new node has a fake value."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if "val" not in node.meta:
            raise AssertionError(f"{ctx.fqn}: node {node.name} lost its meta['val']")
        if node.target in C.LAUNCH_OPS:
            users = list(node.users)
            if len(users) != 1 or users[0].target is not C.WAIT:
                raise AssertionError(f"{ctx.fqn}: collective {node.name} is not followed by exactly one wait")
    if ctx.cores_rewritten == 0:
        raise AssertionError(f"{ctx.fqn}: no core was rewritten")
    return gm
