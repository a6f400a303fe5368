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
    return q_len, q_len * ctx.cp_size


def check_declared_window(ctx: PassContext, global_len: int) -> None:
    """Refuse a sliding window that cuts the global sequence (a window covering it is plain
    causal attention). The local mask cannot be trusted for this: a window at least as long as
    a rank's shard looks fully causal on that shard, and transformers then passes no mask."""
    window = ctx.declared.window
    if window is not None and window < global_len:
        raise UnsupportedMaskError(
            f"{ctx.fqn}: {ctx.declared.window_module} declares sliding-window attention (sliding_window={window}) "
            f"and the global sequence has {global_len} tokens; CP's local attention kernels have no sliding "
            f"window yet. Use sequences of at most {window} tokens, or a model without sliding windows"
        )


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


def gathered_key_valid(emit: Emitter, ctx: PassContext, key_valid: fx.Node) -> fx.Node:
    """Gather local key validity `[B, 1, S_local]` into `[B, S_global]` (bool, rank order).

    Every rank gathers it, with or without padding of its own: Hugging Face drops the mask on a
    rank whose shard has no padding while another rank of the batch passes one, and every rank
    must issue the same collectives (and attend to the other ranks' padding).
    """
    as_bytes = emit(aten._to_copy.default, key_valid, dtype=torch.uint8)  # gloo has no bool
    gathered = all_gather_sequence(emit, ctx, as_bytes, seq_dim=2, purpose="key padding mask")
    return emit(aten.ne.Scalar, emit(aten.squeeze.dim, gathered, 1), 0)


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
                         value: fx.Node, key_valid: fx.Node, chunk_starts: list[int], causal: bool) -> fx.Node:
    """The attention a rank computes after its collectives (`kernels.attention.local_attention`):
    `query` in equal chunks at global `chunk_starts`, `key`/`value` and `key_valid [B, S]` in
    global order. The kernels are chosen here, from the traced device and dtype, and named in the
    dump; nothing `[S_q, S_kv]` is built."""
    if match.dropout_p:
        raise CPInputError(f"{ctx.fqn}: attention dropout ({match.dropout_p}) is not supported by CP's local "
                           "attention kernels; set the model's attention dropout to 0")
    q = val(query)
    kernel = select_kernel(q.device, q.dtype)
    masked_kernel = select_kernel(q.device, q.dtype, masked=True)
    scale = match.scale if match.scale is not None else q.shape[-1] ** -0.5
    note_once(ctx, f"local attention: {kernel} blocks (no padded key), {masked_kernel} with padded keys; "
                   "nothing S_q x S_kv")
    return emit.core(local_attention, query, key, value, key_valid, list(chunk_starts), causal, float(scale), kernel,
                     masked_kernel, fake=local_attention_fake)
