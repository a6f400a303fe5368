"""Rewrite a traced GDN layer for context parallelism with the region's method.

Every method first gives the causal conv its true left context (`fill_conv_halo`): the last
`kernel − 1` pre-conv tokens of rank r−1 (zeros on rank 0) replace the zero left-pad. Then the
method rewrites the core: Ulysses (`ulysses.py`), State-P2P (`p2p.py`), State-AllGather
(`all_gather.py`).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...errors import CPInputError
from ...methods import method_spec
from ..comm import note_once, shift_to_next_rank
from ..graph_utils import Emitter, val
from .fragments import PASS
from .match import CORE, GdnMatch

aten = torch.ops.aten


def gdn_rewrite_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.method.core != CORE:
        return gm
    spec = method_spec(ctx.method)  # each method registers its rewrite in its own file
    for match in spec.find(gm):
        fill_conv_halo(gm, match, ctx)
        spec.rewrite(gm, match, ctx)
        ctx.cores_rewritten += 1
    gm.graph.lint()
    gm.recompile()
    return gm


def fill_conv_halo(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    """Replace the conv's zero left-pad by rank r−1's last `halo` tokens (`[B, C, T]` layout)."""
    pad = match.conv_pad
    x = pad.args[0]
    length = val(x).shape[-1]
    if length < match.halo:
        raise CPInputError(
            f"{ctx.fqn}: local sequence length {length} is shorter than the conv halo ({match.halo} tokens); "
            "use fewer CP ranks or a longer sequence"
        )
    emit = Emitter(gm.graph, pad, PASS)
    tail = emit(aten.slice.Tensor, x, 2, length - match.halo, length)
    rows = emit(aten.permute.default, tail, [2, 0, 1])  # [halo, B, C]
    received = shift_to_next_rank(emit, ctx, rows, purpose=f"conv halo ({match.halo} tokens from rank r-1)")
    halo = emit(aten.permute.default, received, [1, 2, 0])
    match.replace_pad_with(emit(aten.cat.default, [halo, x], 2))
    note_once(ctx, f"conv halo: {match.halo} tokens from rank r-1 (zeros on rank 0)")

