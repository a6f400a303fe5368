"""Head-Tail load-balanced AllGather CP for one SDPA core.

The sequence is cut into 2·cp chunks of c tokens and cp rank r holds chunks r ("head") and
t = 2·cp−1−r ("tail"), in that order (`shard_batch` reorders the batch). Under causality the
head chunk sees few keys and the tail chunk many, so every rank does the same work.

K, V and key validity are all-gathered over cp, which concatenates them rank by rank:
[c_0, c_{2cp-1}, c_1, c_{2cp-2}, …]. They are then put back into global order (one copy of
K and V), because in global order the keys a chunk can see are a prefix: the head chunk attends
to the first (r+1)·c keys and the tail chunk to the first (t+1)·c, so a rank scores (2·cp+1)·c²/2
query-key pairs per head, the same on every rank — the saving load balancing is for. Both chunks
go to one `local_attention` call (chunks at global starts r·c and t·c); autograd closes the
backward (the gathers become reduce-scatters).

A packed batch is cut per document instead (`documents.per_document_head_tail`): every rank holds
a head and a tail piece of every document, so the rank's token positions depend on the batch and
reach the region as one more input (`cp_query_positions`, `[B, S_local]`, rising; read off the
attention's `position_ids`, `adapters/sdpa.py`). Then K, V, the key tags and those positions are
all-gathered, the keys are put in global order by sorting the gathered positions (a gather, O(S)),
and `local_attention` runs its masked path at the given query positions. The call without that
input (one document per row) keeps the static chunks above.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...documents import QUERY_POSITIONS
from ...errors import CPInputError
from ...methods import HEAD_TAIL, register_method
from ..comm import all_gather_sequence, note_once
from ..graph_utils import Emitter, evaluate_node, val
from .fragments import (
    all_valid_keys, check_self_attention, core_inputs, emit_local_attention, gathered_key_tags, mask_row,
    region_position_ids, region_tensor_input,
)
from .masks import CAUSAL, classify_local_mask
from .match import SdpaMatch, sdpa_method

aten = torch.ops.aten
SEQ_DIM = 2  # SDPA layout [B, H, S, D]; gathered key tags are [B, S]
KEY_TAGS_SEQ_DIM = 1


def rewrite_head_tail(gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.node, "sdpa_head_tail")
    positions = region_tensor_input(gm, QUERY_POSITIONS)
    if positions is not None:
        return rewrite_per_document(gm, emit, match, ctx, positions)
    local_len, _ = check_self_attention(match, ctx)
    chunk = chunk_length(ctx, local_len)
    causal, local_valid = head_tail_key_validity(emit, gm, match, ctx, chunk)
    starts = [index * chunk for index in local_chunks(ctx)]
    key_tags = to_global_order(emit, gathered_key_tags(emit, gm, ctx, local_valid, starts), KEY_TAGS_SEQ_DIM,
                               ctx.cp_size)
    query, local_key, local_value = core_inputs(emit, match)
    key = to_global_order(emit, all_gather_sequence(emit, ctx, local_key, SEQ_DIM, "K"), SEQ_DIM, ctx.cp_size)
    value = to_global_order(emit, all_gather_sequence(emit, ctx, local_value, SEQ_DIM, "V"), SEQ_DIM, ctx.cp_size)
    match.replace_with(gm, emit_local_attention(emit, ctx, match, query, key, value, key_tags, starts, causal))
    head, tail = local_chunks(ctx)
    note_once(ctx, f"head-tail: local chunks {head} and {tail} of {2 * ctx.cp_size} ({chunk} tokens each); "
                   "K/V gathered over cp and put in global order, each chunk attends to its visible key prefix")


def rewrite_per_document(gm: fx.GraphModule, emit: Emitter, match: SdpaMatch, ctx: PassContext,
                         positions: fx.Node) -> None:
    """Head-Tail of a packed batch cut per document: queries at the data's `positions`."""
    local_len, _ = check_self_attention(match, ctx)
    position_ids = region_position_ids(gm)
    if match.attn_mask is not None or not match.is_causal or position_ids is None:
        raise CPInputError(f"{ctx.fqn}: per-document Head-Tail (a packed batch) needs causal attention without a "
                           "mask and the attention to receive position_ids (Hugging Face attention does)")
    query, local_key, local_value = core_inputs(emit, match)
    batch = val(query).shape[0]
    here = emit(aten.expand.default, emit(aten._to_copy.default, positions, dtype=torch.long), [batch, local_len])
    within = emit(aten.expand.default, emit(aten._to_copy.default, position_ids, dtype=torch.long),
                  [batch, local_len])
    document = emit(aten.sub.Tensor, here, within)  # where each token's document starts: its key tag
    tags, everywhere = (emit(aten.squeeze.dim, all_gather_sequence(emit, ctx, emit(aten.unsqueeze.default, x, 1),
                                                                  seq_dim=2, purpose=purpose), 1)
                        for x, purpose in ((document, "documents"), (here, "token positions")))
    order = emit(aten.argsort.default, everywhere, 1)  # [B, S]: the gathered slot of every global position
    key_tags = emit(aten.gather.default, tags, 1, order)
    key, value = (in_global_order(emit, all_gather_sequence(emit, ctx, x, SEQ_DIM, name), order)
                  for x, name in ((local_key, "K"), (local_value, "V")))
    match.replace_with(gm, emit_local_attention(emit, ctx, match, query, key, value, key_tags, [0], True, here))
    note_once(ctx, "head-tail per document (packed batch): K/V, documents and token positions gathered over cp, "
                   "K/V put in global order; queries at the batch's positions")


def in_global_order(emit: Emitter, gathered: fx.Node, order: fx.Node) -> fx.Node:
    """`[B, H, S, D]` in gathered (rank-major) order -> global order, by `order [B, S]`."""
    shape = list(val(gathered).shape)
    index = emit(aten.expand.default, emit(aten.view.default, order, [shape[0], 1, shape[2], 1]), shape)
    return emit(aten.gather.default, gathered, SEQ_DIM, index)


def local_chunks(ctx: PassContext) -> tuple[int, int]:
    """Global indices of the two chunks this rank holds, in local order (head, then tail)."""
    return ctx.cp_rank, 2 * ctx.cp_size - 1 - ctx.cp_rank


def chunk_length(ctx: PassContext, local_len: int) -> int:
    if local_len % 2:
        raise CPInputError(
            f"{ctx.fqn}: Head-Tail load balance needs an even local sequence length (two chunks per rank), "
            f"got {local_len}; the global length must be a multiple of 2*cp_size={2 * ctx.cp_size} "
            "(cpcompile.shard_batch checks this, or pads with pad=True)"
        )
    return local_len // 2


def to_global_order(emit: Emitter, gathered: fx.Node, seq_dim: int, cp_size: int) -> fx.Node:
    """Gathered order [c_0, c_{2cp-1}, c_1, c_{2cp-2}, …] → global order [c_0, …, c_{2cp-1}].

    Viewing the sequence as [cp, 2, c]: the head chunks are slot 0 in rank order, the tail
    chunks slot 1 in reverse rank order.
    """
    shape = list(val(gathered).shape)
    per_rank = emit(aten.reshape.default, gathered,
                    shape[:seq_dim] + [cp_size, 2, shape[seq_dim] // (2 * cp_size)] + shape[seq_dim + 1:])
    heads = emit(aten.select.int, per_rank, seq_dim + 1, 0)
    tails = emit(aten.flip.default, emit(aten.select.int, per_rank, seq_dim + 1, 1), [seq_dim])
    ordered = emit(aten.cat.default, [heads, tails], seq_dim)
    return emit(aten.reshape.default, ordered, shape)


def prefix(emit: Emitter, x: fx.Node, seq_dim: int, length: int) -> fx.Node:
    return emit(aten.slice.Tensor, x, seq_dim, 0, length)


def head_tail_key_validity(emit: Emitter, gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext,
                           chunk: int) -> tuple[bool, fx.Node]:
    """Whether the core is causal and its local key validity `[B, 1, 2c]`, read so that one
    graph is right for both masks Hugging Face builds for Head-Tail positions.

    With a 2-D padding mask HF passes causal∧key-valid (over the local order); without one it
    reads the jump in position ids between the two local chunks as two packed sequences and
    masks each chunk causally on its own. In both, the last query row of each chunk sees every
    key of that chunk, so validity is taken from those two rows — the same graph stays correct
    whichever mask a later call brings. Any other mask is refused when the region is traced.
    """
    if match.attn_mask is None:
        if not match.is_causal:
            raise CPInputError(f"{ctx.fqn}: Head-Tail load balance needs causal attention")
        query = val(match.query)
        return True, all_valid_keys(emit, query.shape[0], query.shape[SEQ_DIM], query.device)
    local_mask = evaluate_node(gm, match.attn_mask, ctx.example_inputs)
    if not is_chunkwise_causal(local_mask, chunk) and classify_local_mask(local_mask, ctx.fqn) != CAUSAL:
        raise CPInputError(f"{ctx.fqn}: Head-Tail load balance needs causal attention; the mask is key-padding only")
    head_row, tail_row = mask_row(emit, match.attn_mask, chunk - 1), mask_row(emit, match.attn_mask, 2 * chunk - 1)
    head_keys = emit(aten.slice.Tensor, head_row, 2, 0, chunk)
    tail_keys = emit(aten.slice.Tensor, tail_row, 2, chunk, 2 * chunk)
    return True, emit(aten.cat.default, [head_keys, tail_keys], 2)


def is_chunkwise_causal(mask: torch.Tensor, chunk: int) -> bool:
    """True for a boolean `[..., 2c, 2c]` mask that is causal inside each chunk and blocks across them."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2:] != (2 * chunk, 2 * chunk):
        return False
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=mask.device).tril()
    return torch.equal(mask, torch.block_diag(causal, causal).expand_as(mask))


LOAD_BALANCE = register_method(sdpa_method("head_tail", rewrite_head_tail, layout=HEAD_TAIL))
