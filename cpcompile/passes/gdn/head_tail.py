"""GDN in Head-Tail order: what every Head-Tail GDN method shares.

Rank r of P holds two fragments of the sequence's 2P equal chunks, chunk r (its *head*) then chunk
2P−1−r (its *tail*), as `shard_batch` lays out a Head-Tail batch. In sequence order the chunks
belong to ranks 0, 1, …, P−1 (their heads), then P−1, …, 1, 0 (their tails):

    chunk   0   1   …   P−1 | P     …   2P−2   2P−1
    rank    0   1   …   P−1 | P−1   …    1      0
            heads: the state flows up | tails: it flows back down

So a head's conv halo is rank r−1's head end (zeros on rank 0) and a tail's is rank r+1's tail end,
except on rank P−1, whose tail follows its own head (`fill_head_tail_conv_halo`: one all-to-all
with both neighbours). A fragment's entering state composes the summaries of every chunk before
it; the methods differ in how (`p2p_head_tail.py` relays the state, `all_gather_head_tail.py`
gathers the summaries). Both fragments of a rank run as one batch: token tensors `[B, 2c, ...]`
fold to `[2B, c, ...]`, heads first (`fold`), so each GDN op runs once, over both.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx

from ...context import PassContext
from ...errors import CPInputError
from ...kernels.gdn.conv import causal_conv
from ..comm import exchange_with_neighbours, note_once
from ..graph_utils import Emitter, val
from .conv_taps import find_conv_taps, taps_per_fragment
from .fragments import PASS
from .match import CONV_OPS, SLICE_OPS, GdnMatch, conv_args

aten = torch.ops.aten
HEAD, TAIL = 0, 1  # a fragment's slot on its rank (its place in the local order)


def sequence_owners(cp_size: int) -> list[tuple[int, int]]:
    """`(rank, slot)` of every chunk, in sequence order."""
    return [(rank, HEAD) for rank in range(cp_size)] + [(rank, TAIL) for rank in reversed(range(cp_size))]


def fragment_length(ctx: PassContext, local_len: int) -> int:
    if local_len % 2:
        raise CPInputError(
            f"{ctx.fqn}: GDN in Head-Tail order needs an even local sequence length (two fragments per rank), got "
            f"{local_len}; the global length must be a multiple of 2*cp_size={2 * ctx.cp_size} "
            "(cpcompile.shard_batch checks this, or pads with pad=True)")
    return local_len // 2


# ----------------------------------------------------------------------------- folding


def fold(emit: Emitter, x: fx.Node) -> fx.Node:
    """`[B, 2c, *rest]` (head, tail) -> `[2B, c, *rest]`: the heads' rows, then the tails'."""
    batch, length, *rest = val(x).shape
    pieces = emit(aten.reshape.default, x, [batch, 2, length // 2, *rest])
    slot_major = emit(aten.transpose.int, pieces, 0, 1)
    return emit(aten.reshape.default, slot_major, [2 * batch, length // 2, *rest])


def unfold(emit: Emitter, x: fx.Node) -> fx.Node:
    """Inverse of `fold`: `[2B, c, *rest]` -> `[B, 2c, *rest]`."""
    rows, length, *rest = val(x).shape
    slots = emit(aten.reshape.default, x, [2, rows // 2, length, *rest])
    batch_major = emit(aten.transpose.int, slots, 0, 1)
    return emit(aten.reshape.default, batch_major, [rows // 2, 2 * length, *rest])


def slot_rows(emit: Emitter, x: fx.Node, slot: int) -> fx.Node:
    """The head (slot 0) or tail (slot 1) rows of a folded `[2B, ...]` tensor."""
    half = val(x).shape[0] // 2
    return emit(aten.slice.Tensor, x, 0, slot * half, (slot + 1) * half)


class FoldedCore(NamedTuple):
    """A core's inputs folded to `[2B, c, ...]`, and its document starts (None: one document a row)."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    g: fx.Node
    beta: fx.Node
    starts: fx.Node | None

    @property
    def tokens(self) -> tuple[fx.Node, ...]:
        return self.q, self.k, self.v, self.g, self.beta


def fold_core_inputs(emit: Emitter, match: GdnMatch, ctx: PassContext) -> FoldedCore:
    fragment_length(ctx, val(match.inputs[0]).shape[1])
    starts = None if match.starts is None else fold(emit, match.starts)
    return FoldedCore(*(fold(emit, x) for x in match.inputs), starts)


# ----------------------------------------------------------------------------- conv halo


def fill_head_tail_conv_halo(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    """Give both fragments' conv its true left context (`[B, C, T]` layout): the last `halo`
    pre-conv tokens of the chunk before each, wherever it lives.

    The traced conv reads one left-padded `[B, C, 2c]` input, whose tail would see the head's end;
    it is replaced by the conv of each fragment with its own halo in front: a depthwise `conv1d`
    becomes two `causal_conv` calls, and so does the packed-documents conv (`conv_taps`, traced
    tap by tap: `conv_taps.taps_per_fragment`), each with its fragment's positions, whose test
    stops the halo at a document start as on a contiguous rank. Taps not recognised as that are
    rewritten slice by slice: each reads the same window of both fragments' histories."""
    pad = match.conv_pad
    x = pad.args[0]
    length = val(x).shape[-1]
    chunk = fragment_length(ctx, length)
    if chunk < match.halo:
        raise CPInputError(
            f"{ctx.fqn}: a Head-Tail fragment of {chunk} tokens is shorter than the conv halo ({match.halo} tokens); "
            "use fewer CP ranks or a longer sequence")
    emit = Emitter(gm.graph, pad, PASS)
    histories = [emit(aten.cat.default, [halo, emit(aten.slice.Tensor, x, 2, slot * chunk, (slot + 1) * chunk)], 2)
                 for slot, halo in enumerate(_fragment_halos(emit, ctx, x, chunk, match.halo))]
    taps = find_conv_taps(pad)
    if taps is not None:  # packed documents: one causal_conv a fragment (the pad then has no users)
        taps_per_fragment(gm, taps, histories, chunk, match.backend)
    for user in list(pad.users):
        if user.target in CONV_OPS:
            user.replace_all_uses_with(_conv_per_fragment(emit, user, histories, match.backend))
        elif user.target in SLICE_OPS and user.args[1] == 2:
            start = user.args[2]
            windows = [emit(aten.slice.Tensor, h, 2, start, start + chunk) for h in histories]
            user.replace_all_uses_with(emit(aten.cat.default, windows, 2))
        else:
            raise CPInputError(f"{ctx.fqn}: the GDN conv's left pad feeds {user.target}; Head-Tail order "
                               "knows a depthwise conv1d or the packed-documents conv taps only")
        gm.graph.erase_node(user)
    gm.graph.erase_node(pad)
    note_once(ctx, f"conv halo: {match.halo} tokens per fragment, the head's from rank r-1's head (zeros on rank 0), "
                   "the tail's from rank r+1's tail (rank P-1: its own head), one all-to-all")


def _fragment_halos(emit: Emitter, ctx: PassContext, x: fx.Node, chunk: int, halo: int) -> list[fx.Node]:
    """`[B, C, halo]` left context of the head and of the tail."""
    def end_rows(slot: int) -> fx.Node:  # the fragment's last `halo` tokens as rows [halo, B, C]
        end = (slot + 1) * chunk
        return emit(aten.permute.default, emit(aten.slice.Tensor, x, 2, end - halo, end), [2, 0, 1])

    head_end = end_rows(HEAD)
    from_previous, from_next = exchange_with_neighbours(emit, ctx, head_end, end_rows(TAIL),
                                                        purpose=f"conv halo ({halo} tokens per fragment)")
    head_halo = from_previous if ctx.cp_rank > 0 else emit(aten.zeros_like.default, from_previous)
    tail_halo = from_next if ctx.cp_rank < ctx.cp_size - 1 else head_end
    return [emit(aten.permute.default, rows, [1, 2, 0]) for rows in (head_halo, tail_halo)]


def _conv_per_fragment(emit: Emitter, conv: fx.Node, histories: list[fx.Node], backend: str) -> fx.Node:
    """`conv1d(history, weight, bias)` of the traced layer as one `causal_conv` per fragment."""
    _, weight, bias, stride, padding, dilation, groups = conv_args(conv)
    depthwise = weight is not None and val(weight).shape[1] == 1 and groups == val(histories[0]).shape[1]
    if conv.kwargs or not (depthwise and set(stride) == {1} and set(padding) == {0} and set(dilation) == {1}):
        raise CPInputError(f"the GDN conv {conv.name} is not a stride-1 depthwise conv1d without padding; "
                           "Head-Tail order splits only that conv per fragment")
    return emit(aten.cat.default, [emit(causal_conv, h, weight, bias, backend) for h in histories], 2)
