"""What every GDN method shares: its spec (`gdn_method`) and the step before its rewrite.

Every method first gives the causal conv its true left context (`fill_conv_halo`): the last
`kernel − 1` pre-conv tokens of rank r−1 (zeros on rank 0) replace the zero left-pad, and a
traced `F.conv1d` becomes a call of `kernels.gdn.conv.causal_conv` (`conv_for_compile`; the
packed-documents taps likewise, `conv_taps.taps_for_compile`), and q, k
and v reach the core contiguous when compiled (`contiguous_qkv_when_compiled`); in
Head-Tail order each of a rank's two fragments gets its own (`head_tail.fill_head_tail_conv_halo`).
Then the method rewrites the core (`passes/cores.py` runs both): Ulysses (`ulysses.py`), State-P2P (`p2p.py`), State-AllGather
(`all_gather.py`), and in Head-Tail order `p2p_head_tail.py`, `all_gather_head_tail.py`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...context import PassContext
from ...errors import CPInputError
from ...kernels.gdn.conv import causal_conv
from ...kernels.gdn.layout import contiguous_when_compiled
from ...methods import CONTIGUOUS, HEAD_TAIL, MethodSpec
from ..comm import note_once, shift_to_next_rank
from ..graph_utils import Emitter, val
from .conv_taps import taps_for_compile
from .fragments import PASS
from .head_tail import fill_head_tail_conv_halo
from .match import CONV_OPS, CORE, GdnMatch, conv_args, find_gdn_cores

aten = torch.ops.aten


def gdn_method(name: str, rewrite, layout: str = CONTIGUOUS) -> MethodSpec:
    """The spec of a GDN method: its core is one `cpcompile::gdn_chunk` node, and before its rewrite
    the conv gets its halo (`fill_halo`). The region adapter is the model's: its wrappers name it
    (`adapter` parameter). In Head-Tail order a rank's fragments are the layout's two chunks,
    packed batch or not (`CPMethod.fixed_chunks`)."""
    return MethodSpec(core=CORE, name=name, find=find_gdn_cores, rewrite=rewrite, layout=layout,
                      fixed_chunks=layout != CONTIGUOUS, prepare=fill_halo)


def fill_halo(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> None:
    """What every GDN method does to a core first (`passes/cores.py` calls it): the conv's halo,
    and q, k, v contiguous when compiled."""
    if ctx.method.layout == HEAD_TAIL:  # two fragments a rank: a halo and a conv each
        fill_head_tail_conv_halo(gm, match, ctx)
    else:
        history = fill_conv_halo(gm, match, ctx)
        for conv in [user for user in history.users if user.target in CONV_OPS]:
            conv_for_compile(gm, conv, match.backend)
        taps_for_compile(gm, history, match.backend)  # packed documents: the traced taps, one call
    contiguous_qkv_when_compiled(gm, match)


def contiguous_qkv_when_compiled(gm: fx.GraphModule, match: GdnMatch) -> None:
    """The core's q, k and v through `contiguous_when_compiled` (`kernels/gdn/layout.py`): the layer's
    own code makes them contiguous only when Dynamo traces it, and `torch.export` traced the region."""
    emit = Emitter(gm.graph, match.node, PASS)
    args = list(match.node.args)
    args[:3] = [emit(contiguous_when_compiled, x) for x in args[:3]]
    match.node.args = tuple(args)


def fill_conv_halo(gm: fx.GraphModule, match: GdnMatch, ctx: PassContext) -> fx.Node:
    """Replace the conv's zero left-pad by rank r−1's last `halo` tokens (`[B, C, T]` layout);
    -> the conv's input with that halo in front."""
    pad = match.conv_pad
    x = pad.args[0]
    length = val(x).shape[-1]
    if length < match.halo:
        raise CPInputError(
            f"{ctx.fqn}: local sequence length {length} is shorter than the conv halo ({match.halo} tokens); "
            "use fewer CP ranks or a longer sequence"
        )
    emit = Emitter(gm.graph, pad, PASS)
    tail = emit(aten.slice.Tensor, x, 2, length - match.halo, length)
    rows = emit(aten.permute.default, tail, [2, 0, 1])  # [halo, B, C]
    received = shift_to_next_rank(emit, ctx, rows, purpose=f"conv halo ({match.halo} tokens from rank r-1)")
    halo = emit(aten.permute.default, received, [1, 2, 0])
    history = emit(aten.cat.default, [halo, x], 2)
    match.replace_pad_with(history)
    note_once(ctx, f"conv halo: {match.halo} tokens from rank r-1 (zeros on rank 0)")
    return history


def conv_for_compile(gm: fx.GraphModule, conv: fx.Node, backend: str) -> None:
    """A traced depthwise `conv1d(history, weight, bias)` (stride 1, no padding: the halo is in
    `history`) becomes a call of `causal_conv`: the same `F.conv1d` when the region runs eagerly
    (the Triton conv on the triton core `backend` on CUDA), its fused taps when a compiled layer
    inlines the region (Dynamo traces the call). Any other conv, or one traced with keyword
    arguments, is left as traced."""
    if conv.kwargs:
        return
    history, weight, bias, stride, padding, dilation, groups = conv_args(conv)
    depthwise = weight is not None and val(weight).shape[1] == 1 and groups == val(history).shape[1]
    if not (depthwise and set(stride) == {1} and set(padding) == {0} and set(dilation) == {1}):
        return
    with gm.graph.inserting_before(conv):
        call = gm.graph.call_function(causal_conv, (history, weight, bias, backend))
    call.meta.update(conv.meta)
    conv.replace_all_uses_with(call)
    gm.graph.erase_node(conv)


