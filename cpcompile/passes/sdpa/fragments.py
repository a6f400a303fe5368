"""Graph fragments shared by the SDPA rewrites: the self-attention check, key validity, and
emitting the local attention that replaces a core. Collectives: `passes/comm.py`."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...errors import CPInputError, UnsupportedMaskError
from ...kernels.attention import local_attention, local_attention_fake, select_kernel
from ..comm import all_gather_sequence, note_once
from ..graph_utils import Emitter, evaluate_node, val
from .masks import CAUSAL, classify_local_mask
from .match import SdpaMatch

aten = torch.ops.aten
SEQ_DIM = 2  # SDPA layout [B, H, S, D]


def check_self_attention(match: SdpaMatch, ctx: PassContext) -> tuple[int, int]:
    """Return (local length, global length); refuse shapes a sequence-sharded rewrite can't serve."""
    q_len = val(match.query).shape[SEQ_DIM]
    kv_len = val(match.key).shape[SEQ_DIM]
    if q_len != kv_len:
        raise CPInputError(
            f"{ctx.fqn}: SDPA has {q_len} queries but {kv_len} keys; CP needs self-attention over "
            "the local shard (no KV cache, no cross-attention)"
        )
    check_declared_window(ctx, q_len * ctx.cp_size)
    check_declared_chunk(ctx, q_len * ctx.cp_size)
    return q_len, q_len * ctx.cp_size


def check_declared_chunk(ctx: PassContext, global_len: int) -> None:
    """Refuse chunked attention whose chunk is shorter than the global sequence (a chunk covering it
    is plain causal attention). Exactness would need the chunks as documents in every method's
    local attention; until then it is refused rather than run as plain causal attention, which
    is what a rank whose shard lies within one chunk would see."""
    _refuse_shorter_span(ctx, global_len, ctx.declared.chunk, ctx.declared.chunk_module,
                         "chunked attention (attention_chunk_size={})", "attention chunks", "")


def check_declared_window(ctx: PassContext, global_len: int) -> None:
    """Refuse a sliding window that cuts the global sequence (a window covering it is plain
    causal attention). The local mask cannot be trusted for this: a window at least as long as
    a rank's shard looks fully causal on that shard, and transformers then passes no mask."""
    _refuse_shorter_span(ctx, global_len, ctx.declared.window, ctx.declared.window_module,
                         "sliding-window attention (sliding_window={})", "sliding window",
                         ", or a model without sliding windows")


def _refuse_shorter_span(ctx: PassContext, global_len: int, span: int | None, module: str, declares: str,
                         kernels_lack: str, alternative: str) -> None:
    if span is not None and span < global_len:
        raise UnsupportedMaskError(
            f"{ctx.fqn}: {module} declares {declares.format(span)} and the global sequence has {global_len} tokens; "
            f"CP's local attention kernels have no {kernels_lack} yet. Use sequences of at most {span} "
            f"tokens{alternative}")


def core_is_causal(match: SdpaMatch, ctx: PassContext, traced_causal: bool, q_len: int) -> bool:
    """Whether the core attends causally: what the traced call says (its flag, or its mask's
    pattern) where that can tell, else what the region's modules declare.

    At one local token the call cannot tell: transformers passes `is_causal = q_len > 1`, and a
    1×1 mask is both causal and not. An explicit `is_causal=True` still means causal.
    """
    if q_len > 1 or (traced_causal and match.attn_mask is None):
        return traced_causal
    if ctx.declared.causal is None:
        raise CPInputError(
            f"{ctx.fqn}: local sequence length 1: the traced SDPA call cannot say whether attention is causal "
            "(transformers passes is_causal = q_len > 1) and no module of the region declares `is_causal`; "
            "give each rank at least 2 tokens, or give the attention module an `is_causal` attribute"
        )
    return ctx.declared.causal


def mask_row(emit: Emitter, local_mask: fx.Node, row: int) -> fx.Node:
    """Key validity `[B, 1, S_local]` read off one query row of a local `[B, H, Sq, Sk]` mask."""
    first_head = emit(aten.slice.Tensor, local_mask, 1, 0, 1)
    return emit(aten.select.int, first_head, 2, row)


def all_valid_keys(emit: Emitter, batch: int, length: int, device) -> fx.Node:
    return emit(aten.ones.default, [batch, 1, length], dtype=torch.bool, device=device)


def region_position_ids(gm: fx.GraphModule) -> fx.Node | None:
    """The region's `position_ids` input, when the model passes them to its attention (Hugging Face
    models do): local tokens' positions, restarting at 0 at each document of a packed batch."""
    return region_tensor_input(gm, "position_ids")


def region_tensor_input(gm: fx.GraphModule, name: str) -> fx.Node | None:
    """The region's input called `name` when the call passed a tensor for it, else None."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name == name and isinstance(node.meta.get("val"), torch.Tensor):
            return node
    return None


def gathered_key_tags(emit: Emitter, gm: fx.GraphModule, ctx: PassContext, key_valid: fx.Node,
                      local_starts: list[int]) -> fx.Node:
    """Every key's tag `[B, S_global]` (int64, rank order): the global position where its document
    starts if it is real, −(that + 1) if it is padding (`kernels/attention/layout.py`).

    A token's document starts at its global position minus its position id (position ids restart
    at 0 at each document of a packed batch, and are global positions otherwise: one document,
    starting at 0). `local_starts` are the global starts of the equal chunks this rank holds.
    Every rank gathers the tags, with or without padding or documents of its own: Hugging Face
    drops the mask on a rank whose shard has no padding while another rank passes one, and every
    rank must issue the same collectives (and attend to the other ranks' padding and documents).
    """
    valid = emit(aten.squeeze.dim, key_valid, 1)  # [B, S_local]
    batch, length = val(valid).shape
    document = local_documents(emit, region_position_ids(gm), ctx, local_starts, batch, length, val(valid).device)
    padding = emit(aten.sub.Tensor, emit(aten.neg.default, document), 1)
    tags = emit(aten.where.self, valid, document, padding)
    gathered = all_gather_sequence(emit, ctx, emit(aten.unsqueeze.default, tags, 1), seq_dim=2,
                                   purpose="key padding and documents")
    return emit(aten.squeeze.dim, gathered, 1)


def local_documents(emit: Emitter, position_ids: fx.Node | None, ctx: PassContext, local_starts: list[int],
                    batch: int, length: int, device) -> fx.Node:
    """`[B, S_local]` int64: where each local token's document starts (0 without position ids)."""
    if position_ids is None:
        return emit(aten.zeros.default, [batch, length], dtype=torch.long, device=device)
    positions = position_ids
    if val(positions).dim() == 3:  # multimodal rope [n, B, S]: the text positions come first
        positions = emit(aten.select.int, positions, 0, 0)
    if val(positions).dim() != 2 or val(positions).shape[-1] != length:
        raise CPInputError(f"{ctx.fqn}: position_ids of shape {tuple(val(position_ids).shape)} do not match the "
                           f"{length} local tokens; pass [B, S] position ids (cpcompile.shard_batch does)")
    chunk = length // len(local_starts)
    global_positions = [emit(aten.arange.start, start, start + chunk, dtype=torch.long, device=device)
                        for start in local_starts]
    here = global_positions[0] if len(global_positions) == 1 else emit(aten.cat.default, global_positions)
    starts = emit(aten.sub.Tensor, here, emit(aten._to_copy.default, positions, dtype=torch.long))
    return emit(aten.expand.default, starts, [batch, length])


def local_key_validity(emit: Emitter, gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext) -> tuple[bool, fx.Node]:
    """Whether the core is causal (`core_is_causal`), and its local key validity `[B, 1, S_local]` (bool).

    Without a mask every local key is valid. With one, the real mask is checked to be
    causal∧key-valid or key-valid alone (anything else is refused) and the validity row is
    read off it: under causality only the last query row sees every key.
    """
    query = val(match.query)
    q_len = query.shape[2]
    if match.attn_mask is None:
        return core_is_causal(match, ctx, match.is_causal, q_len), all_valid_keys(emit, query.shape[0], q_len, query.device)
    if match.is_causal:
        raise UnsupportedMaskError(f"{ctx.fqn}: SDPA with both is_causal=True and a mask is not supported")
    causal = classify_local_mask(evaluate_node(gm, match.attn_mask, ctx.example_inputs), ctx.fqn) == CAUSAL
    causal = core_is_causal(match, ctx, causal, q_len)
    return causal, mask_row(emit, match.attn_mask, q_len - 1 if causal else 0)


def at_core_precision(emit: Emitter, match: SdpaMatch, node: fx.Node) -> fx.Node:
    """`node` in the dtype the core ran at. Under autocast SDPA casts its inputs to the autocast
    dtype, which its traced output shows; the local attention is a custom op that autocast leaves
    alone, so the rewrite casts them itself — before the collectives, so K/V travel at that
    precision too, as they would reach SDPA at CP=1."""
    dtype = val(match.node).dtype
    return node if val(node).dtype == dtype else emit(aten._to_copy.default, node, dtype=dtype)


def core_inputs(emit: Emitter, match: SdpaMatch) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Q, and K/V before Hugging Face's `repeat_kv` (`SdpaMatch.unrepeated_kv`), at the core's precision."""
    key, value, _ = match.unrepeated_kv()
    query, key, value = (at_core_precision(emit, match, x) for x in (match.query, key, value))
    return query, key, value


def emit_local_attention(emit: Emitter, ctx: PassContext, match: SdpaMatch, query: fx.Node, key: fx.Node,
                         value: fx.Node, key_tags: fx.Node, chunk_starts: list[int], causal: bool,
                         query_positions: fx.Node | None = None) -> fx.Node:
    """The attention a rank computes after its collectives (`kernels.attention.local_attention`):
    `query` in equal chunks at global `chunk_starts` (or at `query_positions [B, S_q]`),
    `key`/`value` and `key_tags [B, S]` in global order. The kernels are chosen here, from the
    traced device and dtype, and named in the dump; nothing `[S_q, S_kv]` is built."""
    if match.dropout_p:
        raise CPInputError(f"{ctx.fqn}: attention dropout ({match.dropout_p}) is not supported by CP's local "
                           "attention kernels; set the model's attention dropout to 0")
    q = val(query)
    kernel = select_kernel(q.device, q.dtype)
    head_dim = max(q.shape[-1], val(value).shape[-1])  # what equal_head_sizes gives the kernels
    masked_kernel = select_kernel(q.device, q.dtype, masked=True, head_dim=head_dim,
                                  chunked_queries=query_positions is None)
    scale = match.scale if match.scale is not None else q.shape[-1] ** -0.5
    runs = {True: f"{kernel} (the batch is unmasked)", False: f"{masked_kernel} (the batch masks keys)"}
    note_once(ctx, f"local attention: {kernel} blocks (one unpadded document), {masked_kernel} with padded keys "
                   f"or documents; nothing S_q x S_kv; this graph runs {runs.get(ctx.unmasked, 'either, read per call')}")
    query, key, value, value_size = equal_head_sizes(emit, ctx, query, key, value)
    output = emit.core(local_attention, query, key, value, key_tags, list(chunk_starts), causal, float(scale), kernel,
                       masked_kernel, query_positions, ctx.unmasked, fake=local_attention_fake)
    if val(output).shape[-1] != value_size:
        output = emit(aten.slice.Tensor, output, 3, 0, value_size)
    return output


def equal_head_sizes(emit: Emitter, ctx: PassContext, query: fx.Node, key: fx.Node,
                     value: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, int]:
    """Q, K and V with one head size, and V's own. Multi-head latent attention (DeepSeek-V3) has a
    value head size other than the query/key one, which the fused kernels refuse; padding the
    smaller side with zeros is exact (zero query/key columns add nothing to a score, zero value
    columns give zero output columns, cut off after) and costs only the padded columns, after the
    collectives: K and V travel at their own sizes. The softmax scale was taken from Q before."""
    qk_size, value_size = val(query).shape[-1], val(value).shape[-1]
    if qk_size == value_size:
        return query, key, value, value_size
    width = max(qk_size, value_size)
    note_once(ctx, f"value head size {value_size} differs from the query/key head size {qk_size} (multi-head latent "
                   f"attention): the smaller padded with zeros to {width} for the local kernels, the output cut back")
    query, key, value = (x if val(x).shape[-1] == width else emit(aten.constant_pad_nd.default, x, [0, width - val(x).shape[-1]])
                         for x in (query, key, value))
    return query, key, value, value_size
