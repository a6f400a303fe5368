"""A `local_compute_fn` region: nothing to rewrite — the user's function already is the CP
compute — but its collectives are recorded for the dump and checked against its declaration, and
the schedule pass may order them for overlap (`asynchronous: true`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .. import collectives as C
from ..context import PassContext
from ..errors import CPInputError
from ..methods import MethodSpec, register_method
from ..methods.local_compute import LOCAL_COMPUTE, LOCAL_CORE, lookup
from .graph_utils import Emitter
from .schedule import group_of


@dataclass(frozen=True)
class LocalComputeMatch:
    """The whole region: its traced graph is the user's compute."""


def find_local_compute(gm: fx.GraphModule) -> list[LocalComputeMatch]:
    return [LocalComputeMatch()]


def record_local_compute(gm: fx.GraphModule, match: LocalComputeMatch, ctx: PassContext) -> None:
    declared = lookup(ctx.method)
    launches = [n for n in gm.graph.nodes if n.op == "call_function" and C.is_launch(n.target)]
    if launches and not declared.collectives:
        raise CPInputError(
            f"{ctx.fqn}: local_compute_fn {declared.path} is declared without collectives "
            f"(@cpcompile.local_compute_fn(collectives=False)) but issues {C.collective_kind(launches[0].target)}; "
            "declare it with collectives and set region_dispatch: false"
        )
    for launch in launches:
        wait = next((u for u in launch.users if C.is_wait(u.target)), launch)
        ctx.record(C.collective_kind(launch.target), f"local_compute_fn {declared.path}", launch, wait,
                   group_name=group_of(launch))
        if launch.target in C.LAUNCH_OPS and wait is not launch:
            contiguous_gradient_after(gm, wait)


def contiguous_gradient_after(gm: fx.GraphModule, wait: fx.Node) -> None:
    """Route a waited collective through `contiguous_gradient`, as `comm.collective` does: the
    primitives call it too, but export traces through its autograd (leaving a `view_as`), so
    the backward NCCL needs a contiguous gradient for is restored here."""
    users = list(wait.users)
    emit = Emitter(gm.graph, wait.next, "local_compute")
    guarded = wait
    if C.strict_collectives():  # the test suite: refuse a non-contiguous gradient, as comm.collective does
        guarded = emit(C.check_gradient_layout, guarded, C.collective_kind(wait.args[0].target))
    guarded = emit(C.contiguous_gradient, guarded)
    for user in users:
        user.replace_input_with(wait, guarded)


SPEC = register_method(MethodSpec(core=LOCAL_CORE, name=LOCAL_COMPUTE, find=find_local_compute,
                                  rewrite=record_local_compute, adapter="local_compute"))
register_method(SPEC.async_variant(sync_wrapper="the same local_compute_fn without asynchronous: true"))
