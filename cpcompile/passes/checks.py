"""The last pass: the rewritten region is sound."""
from __future__ import annotations

import torch.fx as fx

from .. import collectives as C
from ..context import PassContext


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
