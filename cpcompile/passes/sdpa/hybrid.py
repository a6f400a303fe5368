"""Hybrid CP for one SDPA core: Ulysses inside sub-groups of u ranks, AllGather across them.

Q/K/V are exchanged sequence→head inside this rank's Ulysses sub-group, K/V are then
all-gathered along the sequence inside its ring sub-group, attention runs on H/u heads of the
queries of u sequence blocks against the whole sequence, and the output goes back head→sequence.
The sub-groups are the ones `compile` created for every rank before any trace (this method's
`subgroups` in its registration); a pass only looks them up (`new_group` is collective and must
never run inside one rank's trace).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch.distributed as dist
import torch.fx as fx

from ...context import PassContext
from ...errors import CPConfigError
from ...methods import register_method
from ..comm import CommGroup, note_once
from .match import SdpaMatch, sdpa_method
from .ulysses import rewrite_head_parallel


def rewrite_hybrid(gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext) -> None:
    degree = ctx.method.params["ulysses_degree"]
    ulysses, ring = hybrid_groups(ctx, degree)
    rewrite_head_parallel(gm, match, ctx, heads=ulysses, keys=ring,
                          label=f"Hybrid (ulysses_degree={degree}, cp_size={ctx.cp_size})", pass_name="sdpa_hybrid")


def hybrid_groups(ctx: PassContext, degree: int) -> tuple[CommGroup, CommGroup]:
    """This rank's (Ulysses, ring) sub-groups, described once per region in the dump notes."""
    if ctx.mesh is None:
        raise CPConfigError(f"{ctx.fqn}: Hybrid CP needs the CPMesh in the pass context, for its sub-groups")
    groups = ctx.mesh.cp_subgroups(degree)  # validates 1 < u < cp and cp % u; cached by build_subgroups
    ulysses = CommGroup(groups.ulysses.group_name, degree, "cp_ulysses")
    ring = CommGroup(groups.ring.group_name, ctx.cp_size // degree, "cp_ring")
    note = (
        f"hybrid ulysses_degree={degree}: all-to-all in cp_ulysses group {ulysses.name!r} "
        f"(global ranks {dist.get_process_group_ranks(groups.ulysses)}), K/V all-gather in cp_ring group "
        f"{ring.name!r} (global ranks {dist.get_process_group_ranks(groups.ring)})"
    )
    note_once(ctx, note)
    return ulysses, ring


def hybrid_subgroups(params: Mapping[str, Any]) -> tuple[int, ...]:
    """The Ulysses degree whose (Ulysses, ring) sub-groups a Hybrid region uses."""
    return (params["ulysses_degree"],)


HYBRID = register_method(sdpa_method("hybrid", rewrite_hybrid, subgroups=hybrid_subgroups))
ASYNC_HYBRID = register_method(HYBRID.async_variant(sync_wrapper="sdpa_hf_hybrid_cp_wrapper"))
