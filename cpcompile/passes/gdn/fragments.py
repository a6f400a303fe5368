"""Graph fragments shared by the GDN rewrites: sequence↔head exchange, and the summary algebra
`H_out = M @ H_in + S` as graph nodes (`cpcompile.kernels.gdn.summary` is the same algebra on tensors).

Token tensors here use the GDN layout `[B, T, H, *rest]` (sequence dim 1, head dim 2).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...context import PassContext
from ...kernels.gdn.summary import state_step
from ..comm import all_to_all, cp_group
from ..graph_utils import Emitter, val
from .match import GdnMatch

aten = torch.ops.aten
GDN_SUMMARY = torch.ops.cpcompile.gdn_summary.default
SEQ, HEADS = 1, 2
PASS = "gdn_rewrite"  # every GDN rewrite stamps its nodes with the pass that runs it


def seq_to_heads(emit: Emitter, ctx: PassContext, x: fx.Node, purpose: str) -> fx.Node:
    """`[B, T/P, H, *rest]` on every rank → `[B, T, H/P, *rest]` (rank r keeps head block r)."""
    return all_to_all(emit, ctx, x, scatter_dim=HEADS, gather_dim=SEQ, group=cp_group(ctx), purpose=purpose)


def heads_to_seq(emit: Emitter, ctx: PassContext, x: fx.Node, purpose: str) -> fx.Node:
    """Inverse of `seq_to_heads`: `[B, T, H/P, *rest]` → `[B, T/P, H, *rest]`."""
    return all_to_all(emit, ctx, x, scatter_dim=SEQ, gather_dim=HEADS, group=cp_group(ctx), purpose=purpose)


def apply_summary(emit: Emitter, m: fx.Node, s: fx.Node, state: fx.Node) -> fx.Node:
    """`M @ H + S`: a segment's effect on the state entering it (in fp32 under autocast too)."""
    return emit(state_step, m, s, state)


def summary_parts(emit: Emitter, summary: fx.Node) -> tuple[fx.Node, fx.Node]:
    return emit(operator.getitem, summary, 0), emit(operator.getitem, summary, 1)


def local_summary(emit: Emitter, match: GdnMatch) -> tuple[fx.Node, fx.Node]:
    """This rank's `(M, S)`; with a document start in its block M is 0 and S the state after the
    last start, so the state chain carries on only that (the kernel zeroes decay across starts)."""
    _, k, v, g, beta = match.inputs
    return summary_of(emit, match, k, v, g, beta, match.starts)


def summary_of(emit: Emitter, match: GdnMatch, k: fx.Node, v: fx.Node, g: fx.Node, beta: fx.Node,
               starts: fx.Node | None) -> tuple[fx.Node, fx.Node]:
    """`(M, S)` of a segment given as token tensors (each batch row a segment of its own), with the
    core's chunk size and backend."""
    extra = () if starts is None else (starts,)
    return summary_parts(emit, emit(GDN_SUMMARY, k, v, g, beta, match.chunk_size, match.backend, *extra))


def zero_state(emit: Emitter, like_s: fx.Node) -> fx.Node:
    s = val(like_s)
    return emit(aten.zeros.default, list(s.shape), dtype=s.dtype, device=s.device)
