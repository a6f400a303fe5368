"""Ulysses CP for one SDPA core, and the head-parallel attention Hybrid builds on.

Each rank trades its sequence block of every head for the whole span of its head group
(sequence→head all-to-all of Q, K and V over d ranks), runs attention on H/d heads (for
Ulysses a plain `is_causal` call over the whole sequence, inside `local_attention`), and trades back (head→sequence all-to-all of the output). Autograd turns each exchange into
its inverse in backward. Pure Ulysses uses d = cp, so the span is the whole sequence; Hybrid
exchanges inside Ulysses sub-groups of d ranks and then all-gathers K/V in its ring group.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...errors import CPInputError
from ...methods import register_method
from ..comm import CommGroup, all_gather_sequence, all_to_all, cp_group, note_once
from ..graph_utils import Emitter, val
from .fragments import check_self_attention, core_inputs, emit_local_attention, gathered_key_tags, local_key_validity
from .match import SdpaMatch, sdpa_method

aten = torch.ops.aten
HEAD_DIM, SEQ_DIM = 1, 2  # SDPA layout [B, H, S, D]


def rewrite_ulysses(gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext) -> None:
    rewrite_head_parallel(gm, match, ctx, heads=cp_group(ctx), keys=None,
                          label=f"Ulysses (cp_size={ctx.cp_size})", pass_name="sdpa_ulysses")


def rewrite_head_parallel(gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext, *, heads: CommGroup,
                          keys: CommGroup | None, label: str, pass_name: str) -> None:
    """Split heads over `heads` (all-to-all) and, when `keys` is given, gather K/V over it.

    Ulysses groups are blocks of consecutive cp ranks (mesh.py), so after the exchange cp rank
    r holds the queries of sequence blocks [g·d, (g+1)·d) with g = r // d: one contiguous span
    starting at g·d·S_local. Gathering K/V over the ring group, whose rank order is g, lays
    those spans end to end: the global sequence.
    """
    emit = Emitter(gm.graph, match.node, pass_name)
    local_len, _ = check_self_attention(match, ctx)
    local_key, local_value, _ = match.unrepeated_kv()
    replicas = kv_replicas(ctx, label, heads.size, val(match.query).shape[HEAD_DIM], val(local_key).shape[HEAD_DIM])
    causal, local_valid = local_key_validity(emit, gm, match, ctx)
    # first: it needs no projection, they run under it
    key_tags = gathered_key_tags(emit, gm, ctx, local_valid, [ctx.cp_rank * local_len])
    query, local_key, local_value = core_inputs(emit, match)
    query = seq_to_heads(emit, ctx, query, heads, "Q")
    key = seq_to_heads(emit, ctx, replicate_heads(emit, local_key, replicas), heads, "K")
    value = seq_to_heads(emit, ctx, replicate_heads(emit, local_value, replicas), heads, "V")
    if keys is not None:
        key = all_gather_sequence(emit, ctx, key, SEQ_DIM, "K", group=keys)
        value = all_gather_sequence(emit, ctx, value, SEQ_DIM, "V", group=keys)
    span = local_len * heads.size  # the queries: one chunk of the group's span, at g·span
    output = emit_local_attention(emit, ctx, match, query, key, value, key_tags,
                                  [(ctx.cp_rank // heads.size) * span], causal)
    match.replace_with(gm, heads_to_seq(emit, ctx, output, heads, "attention output"))


def kv_replicas(ctx: PassContext, label: str, degree: int, q_heads: int, kv_heads: int) -> int:
    """How many copies of each KV head the exchange needs (1 unless KV heads < degree).

    Every rank needs the KV heads its query heads read. With fewer KV heads than ranks,
    copying each KV head degree/kv_heads times gives every rank exactly one, and it is the
    one its query heads use (query heads % degree == 0 keeps a rank's queries in one group).
    """
    if q_heads % degree:
        raise CPInputError(
            f"{ctx.fqn}: {label} splits attention heads over {degree} ranks (cp_size={ctx.cp_size}), but the module has "
            f"{heads_on_rank(ctx, q_heads, 'query')} ({q_heads} % {degree} != 0); use the AllGather wrapper (sdpa_hf), "
            "which has no head constraint"
        )
    if kv_heads % degree == 0:
        return 1
    if degree % kv_heads == 0:
        replicas = degree // kv_heads
        note_once(ctx, f"{label}: {kv_heads} KV heads < {degree} ranks, each KV head replicated {replicas}x "
                       "before the all-to-all")
        return replicas
    raise CPInputError(
        f"{ctx.fqn}: {label} splits attention heads over {degree} ranks (cp_size={ctx.cp_size}), but the module has "
        f"{heads_on_rank(ctx, kv_heads, 'KV')}: neither divisible by {degree} nor a divisor of it, so they can't be "
        "split or replicated evenly; use the AllGather wrapper (sdpa_hf)"
    )


def heads_on_rank(ctx: PassContext, heads: int, kind: str) -> str:
    """`heads` as the traced tensors hold them: under tensor parallelism, this TP rank's share."""
    if ctx.tp_size == 1:
        return f"{heads} {kind} heads"
    return f"{heads} TP-local {kind} heads ({heads * ctx.tp_size} over tp_size={ctx.tp_size})"


def replicate_heads(emit: Emitter, x: fx.Node, replicas: int) -> fx.Node:
    """`[B, H, S, D]` → `[B, H·replicas, S, D]`, each head repeated in place (as HF's repeat_kv)."""
    if replicas == 1:
        return x
    b, h, s, d = val(x).shape
    expanded = emit(aten.expand.default, emit(aten.unsqueeze.default, x, 2), [b, h, replicas, s, d])
    return emit(aten.reshape.default, expanded, [b, h * replicas, s, d])


def seq_to_heads(emit: Emitter, ctx: PassContext, x: fx.Node, group: CommGroup, purpose: str) -> fx.Node:
    return all_to_all(emit, ctx, x, scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM, group=group, purpose=purpose)


def heads_to_seq(emit: Emitter, ctx: PassContext, x: fx.Node, group: CommGroup, purpose: str) -> fx.Node:
    return all_to_all(emit, ctx, x, scatter_dim=SEQ_DIM, gather_dim=HEAD_DIM, group=group, purpose=purpose)


ULYSSES = register_method(sdpa_method("ulysses", rewrite_ulysses))
ASYNC_ULYSSES = register_method(ULYSSES.async_variant(sync_wrapper="sdpa_hf_ulysses_cp_wrapper"))
