"""GDN Ulysses: q, k, v, g, β go sequence→head (all-to-all), the core runs over the whole sequence
on H/P heads, the output comes back head→sequence. Needs key and value heads divisible by cp.
A packed batch's document starts are all-gathered (one small integer `[B, T]` tensor)."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...errors import CPInputError
from ...methods import register_method
from ..comm import all_gather_sequence
from ..graph_utils import Emitter, val
from .fragments import PASS, heads_to_seq, seq_to_heads
from .conv_halo import gdn_method
from .match import GdnMatch

aten = torch.ops.aten


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
    core = match.emit_core(emit, *moved, starts=_all_document_starts(emit, ctx, match.starts))
    match.replace_with(gm, heads_to_seq(emit, ctx, core, purpose="o head->seq"))


def _all_document_starts(emit: Emitter, ctx: PassContext, starts: fx.Node | None) -> fx.Node | None:
    """The whole sequence's document starts `[B, T]` (a packed batch only): every rank runs the core
    over all tokens. Gathered as integers: collectives need not carry bool."""
    if starts is None:
        return None
    as_int = emit(aten._to_copy.default, starts, dtype=torch.int32)
    gathered = all_gather_sequence(emit, ctx, as_int, seq_dim=1, purpose="document starts")
    return emit(aten.ne.Scalar, gathered, 0)


ULYSSES = register_method(gdn_method("ulysses", rewrite_ulysses))
