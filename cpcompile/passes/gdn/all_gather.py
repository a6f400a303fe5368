"""GDN State-AllGather (a comparison path): every rank's (M, S) is all-gathered and rank r composes
ranks 0..r−1 in rank order."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...methods import register_method
from ..comm import gather_ranks, note_once
from ..graph_utils import Emitter
from .fragments import PASS, apply_summary, local_summary, zero_state
from .conv_halo import gdn_method
from .match import GdnMatch

aten = torch.ops.aten


def rewrite_all_gather(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.node, PASS)
    m, s = local_summary(emit, match)
    gathered = [gather_ranks(emit, ctx, x, purpose) for x, purpose in ((m, "summary M"), (s, "summary S"))]
    # Every rank composes every prefix (ordered: M's do not commute) and selects its own, so
    # the gathers are in every rank's backward even where the own prefix is empty (rank 0).
    prefixes = [zero_state(emit, s)]
    for rank in range(ctx.cp_size - 1):
        m_i, s_i = (emit(aten.select.int, x, 0, rank) for x in gathered)
        prefixes.append(apply_summary(emit, m_i, s_i, prefixes[-1]))
    state = emit(aten.select.int, emit(aten.stack.default, prefixes), 0, ctx.cp_rank)
    match.replace_with(gm, match.emit_core(emit, *match.inputs, initial_state=state))
    note_once(ctx, "state prefix: ranks 0..r-1 composed in rank order")


ALL_GATHER = register_method(gdn_method("all_gather", rewrite_all_gather))
