"""AllGather ("Colossal") CP for one SDPA core.

Q stays local. K and V are all-gathered over the cp group (visible launch + wait nodes;
autograd turns each gather into a reduce-scatter in backward). The mask becomes local
queries × global keys: causality uses the local block's global offset, key padding is
gathered from every rank.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...methods import register_method
from ..comm import all_gather_sequence, note_once
from ..graph_utils import Emitter, val
from .fragments import (
    SEQ_DIM, check_self_attention, emit_attention, gathered_key_valid, local_key_validity, visible_keys,
)
from .match import SdpaMatch, sdpa_method


def rewrite_all_gather(gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.node, "sdpa_all_gather")
    q_len, global_len = check_self_attention(match, ctx)
    local_key, local_value, enable_gqa = match.unrepeated_kv()
    key = all_gather_sequence(emit, ctx, local_key, SEQ_DIM, purpose="K")
    value = all_gather_sequence(emit, ctx, local_value, SEQ_DIM, purpose="V")
    causal, mask = global_mask_for(emit, gm, match, ctx, q_len, global_len)
    if not causal:
        match.replace_with(gm, emit_attention(emit, match, match.query, key, value, mask, enable_gqa))
    else:
        blocks = causal_query_blocks(q_len, ctx.cp_rank * q_len)
        outputs = [
            emit_attention(emit, match, slice_seq(emit, match.query, start, end),
                           slice_seq(emit, key, 0, visible), slice_seq(emit, value, 0, visible),
                           slice_seq(emit, slice_seq(emit, mask, start, end), 0, visible, dim=3), enable_gqa)
            for start, end, visible in blocks
        ]
        output = outputs[0] if len(outputs) == 1 else emit(torch.ops.aten.cat.default, outputs, SEQ_DIM)
        match.replace_with(gm, output)
        if len(blocks) > 1:
            note_once(ctx, f"causal attention in {len(blocks)} query blocks, each against only the keys it can see")
    ctx.cores_rewritten += 1


# Fewer, larger attention calls keep kernels efficient; this many queries per block at least.
MIN_QUERY_BLOCK = 128


def causal_query_blocks(q_len: int, q_offset: int) -> list[tuple[int, int, int]]:
    """(start, end, visible keys) per query block of a causal core.

    Under causality a query at global position p sees keys 0..p, so a block of queries
    needs keys only up to its own end: for rank r of P this drops the (P−r−1)/P of the
    gathered keys no local query can see, and splitting the local block into up to 8 parts
    skips most of the masked upper triangle too — work an explicit mask would otherwise do.
    """
    parts = max((n for n in (1, 2, 4, 8) if q_len % n == 0 and q_len // n >= MIN_QUERY_BLOCK), default=1)
    size = q_len // parts
    return [(i * size, (i + 1) * size, q_offset + (i + 1) * size) for i in range(parts)]


def slice_seq(emit: Emitter, x: fx.Node, start: int, end: int, dim: int = SEQ_DIM) -> fx.Node:
    if start == 0 and end == val(x).shape[dim]:
        return x
    return emit(torch.ops.aten.slice.Tensor, x, dim, start, end)


def global_mask_for(emit: Emitter, gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext,
                    q_len: int, global_len: int) -> tuple[bool, fx.Node]:
    """Whether the core is causal, and the local-Q × global-K mask equivalent to what the single-device run would use.

    Hugging Face drops the mask on a rank whose local shard has no padding, while another
    rank of the same batch does pass one; every rank must still issue the same collectives,
    so key validity is always gathered (all-true where the rank had no mask).
    """
    causal, key_valid = local_key_validity(emit, gm, match, ctx)
    gathered = gathered_key_valid(emit, ctx, key_valid)
    return causal, visible_keys(emit, gathered, causal, q_len, global_len, ctx.cp_rank * q_len, val(match.query).device)


ALL_GATHER = register_method(sdpa_method("all_gather", rewrite_all_gather))
ASYNC_ALL_GATHER = register_method(ALL_GATHER.async_variant(sync_wrapper="sdpa_hf_cp_wrapper"))
