"""`local_length_pass`: ops of the model inside a region that read the local sequence length.

The region's symbolic trace (`audit/local_length.py`, run by `InstalledRegion` before the passes)
lists them; here each is found in the region's own graph (`find_length_reads`: the same op, its
same occurrence in graph order, the same source line) and either rewritten or refused:

- `arange(S_local)` counts the local tokens where the single process counted the sequence's
  (Llama-4's attention temperature tuning: `arange(hidden_states.shape[1])`): it becomes the
  rank's tokens' global positions under the method's layout — exact;
- anything else (a reduction over the sequence, arithmetic with the length, a length-sized
  fill value) has no global meaning cpcompile can supply: `UnsupportedError`, naming the node
  and its source line.

Runs after `find_cores_pass` and before the rewrites, on the model's ops as traced.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..audit.local_length import LengthRead, source_line
from ..context import PassContext
from ..documents import QUERY_POSITIONS
from ..errors import UnsupportedError
from ..methods import HEAD_TAIL
from .comm import note_once
from .graph_utils import Emitter, val

aten = torch.ops.aten


@dataclass
class LengthReadMatch:
    """A length read found in the region's graph: its node, and what the symbolic trace said of it."""

    node: fx.Node
    read: LengthRead


def find_length_reads(gm: fx.GraphModule, reads: list[LengthRead], fqn: str) -> list[LengthReadMatch]:
    by_target: dict[object, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            by_target.setdefault(node.target, []).append(node)
    matches = []
    for read in reads:
        nodes = by_target.get(read.target, [])
        node = nodes[read.occurrence] if read.occurrence < len(nodes) else None
        if node is None or source_line(node) != read.source:
            raise UnsupportedError(
                f"{fqn}: {read.describe()} reads the local sequence length, and the region's traced graph does not "
                "hold it at the same place, so it can be neither rewritten nor checked")
        matches.append(LengthReadMatch(node, read))
    return matches


def local_length_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for match in find_length_reads(gm, ctx.length_reads, ctx.fqn):
        if not match.read.positions:
            raise UnsupportedError(
                f"{ctx.fqn}: {match.read.describe()} reads the local sequence length, which under CP is one rank's "
                "slice where the single process meant the whole sequence; cpcompile rewrites only arange(length) "
                "(to the tokens' global positions) and refuses any other use")
        replace_with_global_positions(gm, match, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm


def replace_with_global_positions(gm: fx.GraphModule, match: LengthReadMatch, ctx: PassContext) -> None:
    """`arange(S_local)` → the global positions of this rank's tokens: one block at r·S_local
    (contiguous methods) or the two Head-Tail chunks r and 2·cp−1−r."""
    node = match.node
    length, dtype, device = val(node).shape[0], val(node).dtype, val(node).device
    if ctx.method.layout == HEAD_TAIL:
        if any(n.op == "placeholder" and n.name == QUERY_POSITIONS and isinstance(n.meta.get("val"), torch.Tensor)
               for n in gm.graph.nodes):
            raise UnsupportedError(
                f"{ctx.fqn}: {match.read.describe()} counts the local tokens, and a packed batch cut per document for "
                "Head-Tail orders them per row, which one position per token cannot say; use a contiguous method")
        chunk = length // 2
        starts = [ctx.cp_rank * chunk, (2 * ctx.cp_size - 1 - ctx.cp_rank) * chunk]
    else:
        chunk, starts = length, [ctx.cp_rank * length]
    emit = Emitter(gm.graph, node, "local_length")
    pieces = [emit(aten.arange.start, start, start + chunk, dtype=dtype, device=device) for start in starts]
    positions = pieces[0] if len(pieces) == 1 else emit(aten.cat.default, pieces)
    node.replace_all_uses_with(positions)
    gm.graph.erase_node(node)
    note_once(ctx, f"{match.read.describe()}: rewritten to the tokens' global positions")
