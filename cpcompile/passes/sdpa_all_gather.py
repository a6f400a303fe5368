"""AllGather ("Colossal") CP for one SDPA core.

Q stays local. K and V are all-gathered over the cp group (visible launch + wait nodes;
autograd turns each gather into a reduce-scatter in backward). The mask becomes local
queries × global keys: causality uses the local block's global offset, key padding is
gathered from every rank.
"""
from __future__ import annotations

import torch.fx as fx

from ..context import PassContext
from .find_cores import SdpaMatch
from .graph_utils import Emitter, val
from .sequence_ops import all_gather_sequence, gathered_key_valid, local_key_validity, visible_keys

SEQ_DIM = 2  # SDPA layout [B, H, S, D]


def check_self_attention(match: SdpaMatch, ctx: PassContext) -> tuple[int, int]:
    """Return (local length, global length); refuse shapes a sequence-sharded rewrite can't serve."""
    q_len = val(match.query).shape[SEQ_DIM]
    kv_len = val(match.key).shape[SEQ_DIM]
    if q_len != kv_len:
        raise ValueError(
            f"{ctx.fqn}: SDPA has {q_len} queries but {kv_len} keys; CP needs self-attention over "
            "the local shard (no KV cache, no cross-attention)"
        )
    return q_len, q_len * ctx.cp_size


def rewrite_all_gather(gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.node, "sdpa_all_gather")
    q_len, global_len = check_self_attention(match, ctx)
    local_key, local_value, enable_gqa = match.unrepeated_kv()
    key = all_gather_sequence(emit, ctx, local_key, SEQ_DIM, purpose="K")
    value = all_gather_sequence(emit, ctx, local_value, SEQ_DIM, purpose="V")
    mask = global_mask_for(emit, gm, match, ctx, q_len, global_len)
    match.replace_with(key=key, value=value, attn_mask=mask, is_causal=False, enable_gqa=enable_gqa)
    ctx.cores_rewritten += 1


def global_mask_for(emit: Emitter, gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext,
                    q_len: int, global_len: int) -> fx.Node:
    """The local-Q × global-K mask equivalent to what the single-device run would use.

    Hugging Face drops the mask on a rank whose local shard has no padding, while another
    rank of the same batch does pass one; every rank must still issue the same collectives,
    so key validity is always gathered (all-true where the rank had no mask).
    """
    causal, key_valid = local_key_validity(emit, gm, match, ctx)
    gathered = gathered_key_valid(emit, ctx, key_valid)
    return visible_keys(emit, gathered, causal, q_len, global_len, ctx.cp_rank * q_len, val(match.query).device)
