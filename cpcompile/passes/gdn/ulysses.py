"""GDN Ulysses: q, k, v, g, β go sequence→head (all-to-all), the core runs over the whole sequence
on H/P heads, the output comes back head→sequence. Needs key and value heads divisible by cp."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...errors import CPInputError
from ...methods import register_method
from ..graph_utils import Emitter, val
from .fragments import PASS, heads_to_seq, seq_to_heads
from .match import GdnMatch, gdn_method


def rewrite_ulysses(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    q, k, v, g, beta = match.inputs
    key_heads, value_heads = val(k).shape[2], val(v).shape[2]
    if key_heads % ctx.cp_size or value_heads % ctx.cp_size:
        raise CPInputError(
            f"{ctx.fqn}: GDN Ulysses needs key heads ({key_heads}) and value heads ({value_heads}) divisible "
            f"by cp_size={ctx.cp_size}; use the State-P2P wrapper, which has no head constraint"
        )
    emit = Emitter(gm.graph, match.node, PASS)
    moved = [seq_to_heads(emit, ctx, x, purpose=f"{name} seq->head") for x, name in zip(match.inputs, "q k v g beta".split())]
    core = match.emit_core(emit, *moved)
    match.replace_with(gm, heads_to_seq(emit, ctx, core, purpose="o head->seq"))


ULYSSES = register_method(gdn_method("ulysses", rewrite_ulysses))
