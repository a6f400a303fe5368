"""The packed-documents conv of a traced GDN layer (`kernels.gdn.conv.conv_taps`, traced tap by tap)
as one `causal_conv` call, as the depthwise `conv1d` of an unpacked layer becomes one
(`conv_halo.conv_for_compile`; in Head-Tail order one a fragment, `taps_per_fragment`): the region
then runs the Triton conv eagerly on the triton backend on CUDA, and compiled, Dynamo traces the
same taps again.

Traced, `conv_taps(history, weight, None, positions)` is, for tap = 0 .. K − 1 (back = K − 1 − tap):

    s  = slice(history, 2, tap, tap + T)
    s  = where(unsqueeze(ge(positions, back), 1), s, 0.0)          # not for back = 0
    m  = mul(s, unsqueeze(select(select(weight, 1, 0), 1, tap), 1))
    out = m (tap 0), then add(out, m)

A bias is one more `add` after the sum: it stays in the graph (Qwen3.5's conv has none).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ...kernels.gdn.conv import causal_conv
from ..graph_utils import Emitter
from .fragments import PASS

aten = torch.ops.aten


@dataclass
class ConvTaps:
    """The traced taps on `history`: their sum `out`, the conv's `weight` and document `positions`;
    `nodes` every traced node of the taps (the slices first, `out` last)."""

    out: fx.Node
    weight: fx.Node
    positions: fx.Node
    nodes: list[fx.Node]


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is(node, target, *args) -> bool:
    """`node` calls `target` with these leading args (None: any)."""
    return (isinstance(node, fx.Node) and node.target is target and not node.kwargs and len(node.args) >= len(args)
            and all(a is None or node.args[i] == a for i, a in enumerate(args)))


def _weight_tap(node, tap: int) -> tuple[fx.Node | None, list[fx.Node]]:
    """unsqueeze(select(select(weight, 1, 0), 1, tap), 1) -> (weight, its nodes), else (None, [])."""
    if not _is(node, aten.unsqueeze.default, None, 1):
        return None, []
    inner = node.args[0]
    if not _is(inner, aten.select.int, None, 1, tap) or not _is(inner.args[0], aten.select.int, None, 1, 0):
        return None, []
    return inner.args[0].args[0], [inner.args[0], inner, node]


def _gated(slice_node: fx.Node, back: int) -> tuple[fx.Node | None, fx.Node | None, list[fx.Node]]:
    """where(unsqueeze(ge(positions, back), 1), slice, 0.0) -> (where, positions, its nodes)."""
    where = _only_user(slice_node)
    if not _is(where, aten.where.ScalarOther, None, slice_node, 0.0):
        return None, None, []
    gate = where.args[0]
    if not _is(gate, aten.unsqueeze.default, None, 1) or not _is(gate.args[0], aten.ge.Scalar, None, back):
        return None, None, []
    if len(gate.users) != 1 or len(gate.args[0].users) != 1:
        return None, None, []
    return where, gate.args[0].args[0], [gate.args[0], gate, where]


def find_conv_taps(history: fx.Node) -> ConvTaps | None:
    """The traced `conv_taps` with positions whose every slice reads `history`, or None."""
    slices = sorted(history.users, key=lambda s: s.args[2] if _is(s, aten.slice.Tensor, history, 2) else -1)
    kernel = len(slices)
    if kernel < 2 or [s.args[2] if _is(s, aten.slice.Tensor, history, 2) else None for s in slices] != list(
            range(kernel)):
        return None
    weight = positions = out = None
    nodes = list(slices)
    for tap, tokens in enumerate(slices):
        back = kernel - 1 - tap
        if back:
            tokens, tap_positions, gated = _gated(tokens, back)
            if tokens is None or positions not in (None, tap_positions):
                return None
            positions = tap_positions
            nodes += gated
        mul = _only_user(tokens)
        if not _is(mul, aten.mul.Tensor, tokens):
            return None
        tap_weight, weight_nodes = _weight_tap(mul.args[1], tap)
        if tap_weight is None or weight not in (None, tap_weight) or len(mul.args[1].users) != 1:
            return None
        weight, nodes = tap_weight, nodes + weight_nodes + [mul]
        if out is not None:
            total = _only_user(out)
            if not _is(total, aten.add.Tensor, out, mul) or _only_user(mul) is not total:
                return None
            mul = total
            nodes.append(total)
        out = mul
    return ConvTaps(out, weight, positions, nodes) if positions is not None else None


def taps_for_compile(gm: fx.GraphModule, history: fx.Node, backend: str) -> bool:
    """Replace the traced taps on `history` by `causal_conv(history, weight, None, backend,
    positions)` and erase them; -> whether they were found."""
    taps = find_conv_taps(history)
    if taps is None:
        return False
    with gm.graph.inserting_before(taps.out):
        call = gm.graph.call_function(causal_conv, (history, taps.weight, None, backend, taps.positions))
    call.meta.update(taps.out.meta)
    taps.out.replace_all_uses_with(call)
    for node in reversed(taps.nodes):
        gm.graph.erase_node(node)
    return True


def taps_per_fragment(gm: fx.GraphModule, taps: ConvTaps, histories: list[fx.Node], chunk: int, backend: str) -> None:
    """Head-Tail order: the traced taps (on the rank's left-padded `[B, C, 2c]` input) become one
    `causal_conv` a fragment, on its own history with its half of the positions, concatenated."""
    emit = Emitter(gm.graph, taps.out, PASS)
    convs = [emit(causal_conv, history, taps.weight, None, backend,
                  emit(aten.slice.Tensor, taps.positions, 1, slot * chunk, (slot + 1) * chunk))
             for slot, history in enumerate(histories)]
    taps.out.replace_all_uses_with(emit(aten.cat.default, convs, 2))
    for node in reversed(taps.nodes):
        gm.graph.erase_node(node)
