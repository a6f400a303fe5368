"""GDN State-AllGather in Head-Tail order (a comparison path): both fragments' `(M, S)` of every rank
are all-gathered, and each rank composes the chunks before each of its fragments in sequence order
(`head_tail.sequence_owners`: the heads in rank order, then the tails in reverse rank order)."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...methods import HEAD_TAIL, register_method
from ..comm import gather_ranks, note_once
from ..graph_utils import Emitter, val
from .fragments import PASS, apply_summary, summary_of, zero_state
from .head_tail import HEAD, TAIL, fold_core_inputs, sequence_owners, slot_rows, unfold
from .conv_halo import gdn_method
from .match import GdnMatch

aten = torch.ops.aten


def rewrite_all_gather_head_tail(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.node, PASS)
    folded = fold_core_inputs(emit, match, ctx)
    summaries = summary_of(emit, match, *folded.tokens[1:], folded.starts)
    # [2B, ...] -> [2, B, ...] (slot, then batch), gathered to [P, 2, B, ...]
    m, s = (gather_ranks(emit, ctx, _by_slot(emit, x), purpose)
            for x, purpose in zip(summaries, ("summary M", "summary S")))
    state, entering = zero_state(emit, slot_rows(emit, summaries[1], HEAD)), {}
    for rank, slot in sequence_owners(ctx.cp_size):
        if rank == ctx.cp_rank:
            entering[slot] = state
            if slot == TAIL:  # the rank's last fragment: nothing after it is needed here
                break
        m_i, s_i = (emit(aten.select.int, emit(aten.select.int, x, 0, rank), 0, slot) for x in (m, s))
        state = apply_summary(emit, m_i, s_i, state)
    states = emit(aten.cat.default, [entering[HEAD], entering[TAIL]])
    core = match.emit_core(emit, *folded.tokens, initial_state=states, starts=folded.starts)
    match.replace_with(gm, unfold(emit, core))
    note_once(ctx, "state prefix: both fragments' summaries of every rank gathered, the chunks before each fragment "
                   "composed in sequence order (heads up, tails down)")


def _by_slot(emit: Emitter, x: fx.Node) -> fx.Node:
    rows, *rest = val(x).shape
    return emit(aten.reshape.default, x, [2, rows // 2, *rest])


ALL_GATHER_HEAD_TAIL = register_method(gdn_method("all_gather_head_tail", rewrite_all_gather_head_tail,
                                                  layout=HEAD_TAIL))
