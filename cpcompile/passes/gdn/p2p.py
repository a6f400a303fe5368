"""GDN State-P2P: the local summary (M, S) (`H_out = M H_in + S`) is computed in parallel; the
entering state travels rank 0 → P−1 in P−1 pass-to-next steps of fp32 `M·H + S` (autograd runs the
gradient chain P−1 → 0); the core then runs with that state.

With the triton backend the whole rank-local P2P — summary, point-to-point state exchange with the
ring neighbours, output, and the two-phase backward — is one `cpcompile::gdn_p2p_chunk` node (why:
`kernels/gdn/layer_ops.py`). Packed documents reach it as gates (`common.reset_decay_at_starts`, a graph
node before it): a start cuts the state there, so a segment with a start has M ~ 0 and passes on
only the state after its last start, and no state gradient crosses the start backwards.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...context import PassContext
from ...kernels.gdn.common import reset_decay_at_starts
from ...methods import register_method
from ..comm import note_once, shift_to_next_rank
from ..graph_utils import Emitter
from .fragments import PASS, apply_summary, local_summary, zero_state
from .conv_halo import gdn_method
from .match import GdnMatch

aten = torch.ops.aten
GDN_P2P_CHUNK = torch.ops.cpcompile.gdn_p2p_chunk.default


def rewrite_p2p(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    if match.backend == "triton":
        return rewrite_p2p_triton(gm, match, ctx)
    emit = Emitter(gm.graph, match.node, PASS)
    m, s = local_summary(emit, match)
    state = zero_state(emit, s)
    # Step j: every rank sends M·H + S of the state it holds; rank 0 always holds the true
    # (zero) initial state — it receives zeros — so after step j ranks 0..j+1 hold their true
    # entering states, and P−1 steps reach every rank. Each step moves one fp32 state per rank.
    # Every rank, the last included, sends M·H + S: a collective's backward runs only where its
    # input needs a gradient, and every rank must run the same backward collectives.
    for step in range(ctx.cp_size - 1):
        rows = emit(aten.unsqueeze.default, apply_summary(emit, m, s, state), 0)
        received = shift_to_next_rank(emit, ctx, rows, purpose=f"state chain step {step + 1}/{ctx.cp_size - 1}")
        state = emit(aten.squeeze.dim, received, 0)
    match.replace_with(gm, match.emit_core(emit, *match.inputs, initial_state=state))
    note_once(ctx, f"state chain: {ctx.cp_size - 1} pass-to-next steps of fp32 M.H+S")


def rewrite_p2p_triton(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.node, PASS)
    q, k, v, g, beta = match.inputs
    if match.starts is not None:
        g = emit(reset_decay_at_starts, g, match.starts)
    fused = emit.core(GDN_P2P_CHUNK, q, k, v, g, beta, match.scale, match.chunk_size, ctx.group_name, ctx.cp_rank,
                      ctx.cp_size)
    match.replace_with(gm, emit(operator.getitem, fused, 0))
    note_once(ctx, f"state chain: inside cpcompile::gdn_p2p_chunk (isend/irecv of one fp32 state per step, "
                   f"{ctx.cp_size - 1} steps forward and backward)")


P2P = register_method(gdn_method("p2p", rewrite_p2p))
