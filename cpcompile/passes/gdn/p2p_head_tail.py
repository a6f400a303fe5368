"""GDN State-P2P in Head-Tail order: the entering state is relayed along the sequence, up through
the ranks' heads and back down through their tails (`head_tail.py` draws the order).

Every rank computes both fragments' summaries `(M, S)` at once (the fragments folded into the
batch). Then the head chain: P−1 pass-to-next steps of fp32 `M·H + S`, after which every head holds
its entering state; rank P−1's head then hands its leaving state to its own tail, and the tail
chain runs P−1 pass-to-previous steps. The core runs once over both fragments with their states.
Autograd runs the gradient chain backwards: down the tails, up the heads.

The eager backend writes both chains with collectives (every rank takes part in each of the
2(P−1) steps, as the contiguous eager State-P2P does); the triton backend is one op,
`cpcompile::gdn_p2p_head_tail_chunk`, whose executor sends each state once, point to point
(`kernels/gdn/triton/head_tail_executor.py`). Packed documents reach the triton op as gates, as
in `p2p.py`.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...context import PassContext
from ...kernels.gdn.common import reset_decay_at_starts
from ...methods import HEAD_TAIL, register_method
from ..comm import note_once, shift_to_next_rank, shift_to_previous_rank
from ..graph_utils import Emitter
from .fragments import PASS, apply_summary, summary_of, zero_state
from .head_tail import HEAD, TAIL, fold_core_inputs, slot_rows, unfold
from .conv_halo import gdn_method
from .match import GdnMatch

aten = torch.ops.aten
GDN_P2P_HEAD_TAIL_CHUNK = torch.ops.cpcompile.gdn_p2p_head_tail_chunk.default


def rewrite_p2p_head_tail(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    if match.backend == "triton":
        return rewrite_p2p_head_tail_triton(gm, match, ctx)
    emit = Emitter(gm.graph, match.node, PASS)
    folded = fold_core_inputs(emit, match, ctx)
    m, s = summary_of(emit, match, *folded.tokens[1:], folded.starts)
    (m_head, s_head), (m_tail, s_tail) = [(slot_rows(emit, m, slot), slot_rows(emit, s, slot)) for slot in (HEAD, TAIL)]
    steps = ctx.cp_size - 1
    # Head chain: after step j ranks 0..j+1 hold their head's true entering state (rank 0 always
    # receives zeros). Every rank sends, the last included: each step is one collective on all ranks.
    head = zero_state(emit, s_head)
    for step in range(steps):
        sent = _rows(emit, apply_summary(emit, m_head, s_head, head))
        head = _state(emit, shift_to_next_rank(emit, ctx, sent, purpose=f"head state chain step {step + 1}/{steps}"))
    # Tail chain: rank P−1's tail follows its own head; after step j ranks P−2−j..P−1 hold theirs.
    after_head = apply_summary(emit, m_head, s_head, head)
    tail = after_head
    for step in range(steps):
        sent = _rows(emit, apply_summary(emit, m_tail, s_tail, tail))
        received = shift_to_previous_rank(emit, ctx, sent, purpose=f"tail state chain step {step + 1}/{steps}",
                                          last_keeps=_rows(emit, after_head))
        tail = _state(emit, received)
    states = emit(aten.cat.default, [head, tail])  # folded: heads' rows, then tails'
    core = match.emit_core(emit, *folded.tokens, initial_state=states, starts=folded.starts)
    match.replace_with(gm, unfold(emit, core))
    note_once(ctx, f"state chain: {steps} pass-to-next steps up the heads, then {steps} pass-to-previous steps down "
                   "the tails, of fp32 M.H+S")


def _rows(emit: Emitter, state: fx.Node) -> fx.Node:
    return emit(aten.unsqueeze.default, state, 0)


def _state(emit: Emitter, rows: fx.Node) -> fx.Node:
    return emit(aten.squeeze.dim, rows, 0)


def rewrite_p2p_head_tail_triton(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.node, PASS)
    q, k, v, g, beta, starts = fold_core_inputs(emit, match, ctx)
    if starts is not None:
        g = emit(reset_decay_at_starts, g, starts)
    fused = emit.core(GDN_P2P_HEAD_TAIL_CHUNK, q, k, v, g, beta, match.scale, match.chunk_size, ctx.group_name,
                      ctx.cp_rank, ctx.cp_size)
    match.replace_with(gm, unfold(emit, emit(operator.getitem, fused, 0)))
    note_once(ctx, "state chain: inside cpcompile::gdn_p2p_head_tail_chunk (isend/irecv of one fp32 state per "
                   f"fragment and direction, {2 * (ctx.cp_size - 1)} messages along the sequence forward and backward)")


P2P_HEAD_TAIL = register_method(gdn_method("p2p_head_tail", rewrite_p2p_head_tail, layout=HEAD_TAIL))
