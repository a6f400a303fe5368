"""The rewrite pipeline for one captured region.

Passes are plain functions `name_pass(gm, ctx) -> gm`, run in this order:

1. `find_cores_pass`   — the cores of the kind the region's method rewrites, found once and
                         kept in the context; none is an error (cores.py)
   `local_length_pass` — ops reading the local sequence length: arange(length) → global
                         positions, anything else refused (local_length.py)
2. `rewrite_cores_pass` — each core rewritten by its method, and counted (cores.py): SDPA cores →
                         collectives + local attention (sdpa/); GDN layers → conv halo + Ulysses /
                         state chain / state gather (gdn/); a user's `local_compute_fn`: its
                         collectives recorded and checked (local_compute.py)
3. `schedule_pass`     — async methods: one priority-ordered topological sort puts each launch
                         after its last producer and its wait before its first consumer, then
                         refuses a collective or attention with nothing to overlap (schedule.py)
4. `verify_pass`       — lint, launch/wait pairing, fake values (checks.py)

Outside this pipeline, `backward_schedule.py` applies step 3's order to the backward graphs
Inductor compiles (a post-grad hook `compile` installs for async methods; docs/async.md).

Each pass keeps `meta["val"]` valid; the orchestrator dumps the graph before and after
each pass when a dump is requested. The rewrites of both cores build their collectives from
`comm.py` and edit graphs with `graph_utils.py`.
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from ..context import PassContext
from .checks import verify_pass
from .cores import find_cores_pass, rewrite_cores_pass
from .local_length import local_length_pass
from .schedule import schedule_pass

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


PIPELINE: tuple[Pass, ...] = (
    find_cores_pass, local_length_pass, rewrite_cores_pass, schedule_pass, verify_pass,
)


def run_passes(gm: fx.GraphModule, ctx: PassContext, on_pass=None) -> fx.GraphModule:
    """Run PIPELINE; `on_pass(name, code_before, code_after)` observes each step."""
    for step in PIPELINE:
        before = gm.code if on_pass else ""
        gm = step(gm, ctx)
        if on_pass:
            on_pass(step.__name__, before, gm.code)
    return gm
