"""AllGather ("Colossal") CP for one SDPA core.

Q stays local. K and V are all-gathered over the cp group (visible launch + wait nodes;
autograd turns each gather into a reduce-scatter in backward), and so is key validity. The local
queries, at global offset r·S_local, then attend to the global keys they can see: under
causality the keys before their block whole and their own block causally (`local_attention`);
the keys after it are never read.
"""
from __future__ import annotations

import torch.fx as fx

from ...context import PassContext
from ...methods import register_method
from ..comm import all_gather_sequence
from ..graph_utils import Emitter
from .fragments import (
    SEQ_DIM, check_self_attention, core_inputs, emit_local_attention, gathered_key_tags, local_key_validity,
)
from .match import SdpaMatch, sdpa_method


def rewrite_all_gather(gm: fx.GraphModule, match: SdpaMatch, ctx: PassContext) -> None:
    emit = Emitter(gm.graph, match.node, "sdpa_all_gather")
    q_len, _ = check_self_attention(match, ctx)
    causal, local_valid = local_key_validity(emit, gm, match, ctx)
    # first: it needs no projection, they run under it
    key_tags = gathered_key_tags(emit, gm, ctx, local_valid, [ctx.cp_rank * q_len])
    query, local_key, local_value = core_inputs(emit, match)
    key = all_gather_sequence(emit, ctx, local_key, SEQ_DIM, purpose="K")
    value = all_gather_sequence(emit, ctx, local_value, SEQ_DIM, purpose="V")
    # local queries are one chunk at r·S_local; under causality they read keys up to their own end
    output = emit_local_attention(emit, ctx, match, query, key, value, key_tags, [ctx.cp_rank * q_len], causal)
    match.replace_with(gm, output)


ALL_GATHER = register_method(sdpa_method("all_gather", rewrite_all_gather))
ASYNC_ALL_GATHER = register_method(ALL_GATHER.async_variant(sync_wrapper="sdpa_hf_cp_wrapper"))
