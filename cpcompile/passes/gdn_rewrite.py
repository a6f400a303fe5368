"""Rewrite a Qwen3.5 GDN layer for context parallelism (Ulysses, State-P2P, State-AllGather).

Every method first gives the causal conv its true left context: the last `kernel − 1`
pre-conv tokens of rank r−1 (zeros on rank 0) replace the zero left-pad. Then:

- ulysses: q, k, v, g, β go sequence→head (all-to-all), the core runs over the whole
  sequence on H/P heads, the output comes back head→sequence.
- p2p: the local summary (M, S) (`H_out = M H_in + S`) is computed in parallel; the
  entering state travels rank 0 → P−1 in P−1 pass-to-next steps of fp32 `M·H + S`
  (autograd runs the gradient chain P−1 → 0); the core then runs with that state.
  With the triton backend the whole rank-local P2P — summary, point-to-point state exchange with
  the ring neighbours, output, and the two-phase backward — is one `cpcompile::gdn_p2p_chunk`
  node (why: `kernels/gdn/ops.py`).
- all_gather: every rank's (M, S) is all-gathered and rank r composes ranks 0..r−1.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..context import PassContext
from .find_gdn import GdnMatch, find_gdn_cores
from .gdn_graph_ops import apply_summary, gather_ranks, heads_to_seq, seq_to_heads, shift_to_next_rank, summary_parts
from .graph_utils import Emitter, val
from .sequence_ops import note_once

aten = torch.ops.aten
GDN_SUMMARY = torch.ops.cpcompile.gdn_summary.default
GDN_P2P_CHUNK = torch.ops.cpcompile.gdn_p2p_chunk.default
PASS = "gdn_rewrite"


def gdn_rewrite_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.method.core != "gdn":
        return gm
    rewrite = GDN_REWRITES.get(ctx.method.name)
    if rewrite is None:
        raise NotImplementedError(f"{ctx.fqn}: GDN method {ctx.method.name!r} has no rewrite")
    for match in find_gdn_cores(gm):
        fill_conv_halo(gm, match, ctx)
        rewrite(gm, match, ctx)
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
        raise ValueError(
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


def rewrite_ulysses(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    q, k, v, g, beta = match.inputs
    key_heads, value_heads = val(k).shape[2], val(v).shape[2]
    if key_heads % ctx.cp_size or value_heads % ctx.cp_size:
        raise ValueError(
            f"{ctx.fqn}: GDN Ulysses needs key heads ({key_heads}) and value heads ({value_heads}) divisible "
            f"by cp_size={ctx.cp_size}; use the State-P2P wrapper, which has no head constraint"
        )
    emit = Emitter(gm.graph, match.core, PASS)
    moved = [seq_to_heads(emit, ctx, x, purpose=f"{name} seq->head") for x, name in zip(match.inputs, "q k v g beta".split())]
    core = match.emit_core(emit, *moved)
    match.replace_core_with(gm, heads_to_seq(emit, ctx, core, purpose="o head->seq"))


def local_summary(emit: Emitter, match: GdnMatch) -> tuple[fx.Node, fx.Node]:
    _, k, v, g, beta = match.inputs
    return summary_parts(emit, emit(GDN_SUMMARY, k, v, g, beta, match.chunk_size, match.backend))


def zero_state(emit: Emitter, like_s: fx.Node) -> fx.Node:
    s = val(like_s)
    return emit(aten.zeros.default, list(s.shape), dtype=s.dtype, device=s.device)


def rewrite_p2p(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    if match.backend == "triton":
        return rewrite_p2p_triton(gm, match, ctx)
    emit = Emitter(gm.graph, match.core, PASS)
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
    match.replace_core_with(gm, match.emit_core(emit, *match.inputs, initial_state=state))
    note_once(ctx, f"state chain: {ctx.cp_size - 1} pass-to-next steps of fp32 M.H+S")


def rewrite_p2p_triton(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.core, PASS)
    fused = emit(GDN_P2P_CHUNK, *match.inputs, match.scale, match.chunk_size, ctx.group_name, ctx.cp_rank, ctx.cp_size)
    match.replace_core_with(gm, emit(operator.getitem, fused, 0))
    note_once(ctx, f"state chain: inside cpcompile::gdn_p2p_chunk (isend/irecv of one fp32 state per step, "
                   f"{ctx.cp_size - 1} steps forward and backward)")


def rewrite_all_gather(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.core, PASS)
    m, s = local_summary(emit, match)
    gathered = [gather_ranks(emit, ctx, x, purpose) for x, purpose in ((m, "summary M"), (s, "summary S"))]
    # Every rank composes every prefix (ordered: M's do not commute) and selects its own, so
    # the gathers are in every rank's backward even where the own prefix is empty (rank 0).
    prefixes = [zero_state(emit, s)]
    for rank in range(ctx.cp_size - 1):
        m_i, s_i = (emit(aten.select.int, x, 0, rank) for x in gathered)
        prefixes.append(apply_summary(emit, m_i, s_i, prefixes[-1]))
    state = emit(aten.select.int, emit(aten.stack.default, prefixes), 0, ctx.cp_rank)
    match.replace_core_with(gm, match.emit_core(emit, *match.inputs, initial_state=state))
    note_once(ctx, "state prefix: ranks 0..r-1 composed in rank order")


GDN_REWRITES = {"ulysses": rewrite_ulysses, "p2p": rewrite_p2p, "all_gather": rewrite_all_gather}
