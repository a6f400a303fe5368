"""Graph fragments shared by the SDPA rewrites: the self-attention check, global masks and key
validity, and emitting the attention call that replaces a core. Collectives: `passes/comm.py`."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...errors import CPInputError, UnsupportedMaskError
from ..comm import all_gather_sequence
from ..graph_utils import Emitter, evaluate_node, val
from .masks import CAUSAL, classify_local_mask
from .match import SDPA, SdpaMatch

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
    return q_len, q_len * ctx.cp_size


def global_causal_mask(emit: Emitter, q_len: int, kv_len: int, q_offset: int, device) -> fx.Node:
    """`[q_len, kv_len]` boolean mask: query i (global index q_offset+i) sees keys j ≤ it."""
    q_pos = emit(aten.arange.start, q_offset, q_offset + q_len, device=device)
    k_pos = emit(aten.arange.default, kv_len, device=device)
    return emit(aten.le.Tensor, emit(aten.unsqueeze.default, k_pos, 0), emit(aten.unsqueeze.default, q_pos, 1))


def mask_row(emit: Emitter, local_mask: fx.Node, row: int) -> fx.Node:
    """Key validity `[B, 1, S_local]` read off one query row of a local `[B, H, Sq, Sk]` mask."""
    first_head = emit(aten.slice.Tensor, local_mask, 1, 0, 1)
    return emit(aten.select.int, first_head, 2, row)


def all_valid_keys(emit: Emitter, batch: int, length: int, device) -> fx.Node:
    return emit(aten.ones.default, [batch, 1, length], dtype=torch.bool, device=device)


def gathered_key_valid(emit: Emitter, ctx: PassContext, key_valid: fx.Node) -> fx.Node:
    """Gather local key validity `[B, 1, S_local]` into `[B, 1, 1, S_global]` (bool)."""
    as_bytes = emit(aten._to_copy.default, key_valid, dtype=torch.uint8)  # gloo has no bool
    gathered = all_gather_sequence(emit, ctx, as_bytes, seq_dim=2, purpose="key padding mask")
    as_bool = emit(aten.ne.Scalar, gathered, 0)
    return emit(aten.unsqueeze.default, as_bool, 2)


def local_key_validity(emit: Emitter, gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext) -> tuple[bool, fx.Node]:
    """Whether the core is causal, and its local key validity `[B, 1, S_local]` (bool).

    Without a mask every local key is valid. With one, the real mask is checked to be
    causal∧key-valid or key-valid alone (anything else is refused) and the validity row is
    read off it: under causality only the last query row sees every key.
    """
    query = val(match.query)
    q_len = query.shape[2]
    if match.attn_mask is None:
        return match.is_causal, all_valid_keys(emit, query.shape[0], q_len, query.device)
    if match.is_causal:
        raise UnsupportedMaskError(f"{ctx.fqn}: SDPA with both is_causal=True and a mask is not supported")
    causal = classify_local_mask(evaluate_node(gm, match.attn_mask, ctx.example_inputs), ctx.fqn) == CAUSAL
    return causal, mask_row(emit, match.attn_mask, q_len - 1 if causal else 0)


def visible_keys(emit: Emitter, key_valid: fx.Node, causal: bool, q_len: int, kv_len: int, q_offset: int,
                 device) -> fx.Node:
    """The `[B, 1, q_len, kv_len]` mask of queries at global positions `q_offset + i` against keys
    `0..kv_len-1`: key validity `[B, 1, 1, kv_len]`, and causality when the core is causal."""
    if not causal:
        return key_valid
    return emit(aten.logical_and.default, key_valid, global_causal_mask(emit, q_len, kv_len, q_offset, device))


def emit_attention(emit: Emitter, match: SdpaMatch, query: fx.Node, key: fx.Node, value: fx.Node,
                   attn_mask: fx.Node, enable_gqa: bool) -> fx.Node:
    """A new SDPA call on the given inputs, keeping the core's dropout and scale."""
    return emit(SDPA, query, key, value, attn_mask=attn_mask, dropout_p=match.dropout_p, is_causal=False,
                scale=match.scale, enable_gqa=enable_gqa)
