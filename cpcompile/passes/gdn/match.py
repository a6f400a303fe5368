"""Matcher for the Gated DeltaNet core of a traced GDN layer (the Qwen3.5 adapter traces it as one
`cpcompile::gdn_chunk` node): `find_gdn_cores` returns one `GdnMatch`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ...errors import CPInputError
from ...kernels.gdn import layer_ops  # noqa: F401  (registers the cpcompile:: ops)
from ..graph_utils import CoreMatch

aten = torch.ops.aten
CORE = "gdn"
GDN_CHUNK = torch.ops.cpcompile.gdn_chunk.default
PAD_OPS = (aten.pad.default, aten.constant_pad_nd.default)
CONV_OPS = (aten.conv1d.default, aten.convolution.default)
SLICE_OPS = (aten.slice.Tensor,)


@dataclass
class GdnMatch(CoreMatch):
    """One GDN core (`node`) and the causal conv left-pad that feeds its q/k/v.

    `node` is `cpcompile::gdn_chunk(q, k, v, g, beta, initial_state, scale, chunk_size, backend,
    starts)` with q/k `[B, T, Hk, K]`, v `[B, T, Hv, V]`, g/β `[B, T, Hv]` and `starts` `[B, T]` (the
    first tokens of packed documents; absent for one document per row); `conv_pad` left-pads the
    conv input `[B, C, T]` by `halo` = kernel − 1 zeros, the context a sequence shard lacks.
    """

    conv_pad: fx.Node
    halo: int

    @property
    def inputs(self) -> tuple[fx.Node, ...]:
        return tuple(self.node.args[:5])

    @property
    def scale(self) -> float:
        return self.node.args[6]

    @property
    def chunk_size(self) -> int:
        return self.node.args[7]

    @property
    def backend(self) -> str:
        return self.node.args[8]

    @property
    def starts(self) -> fx.Node | None:
        """The document starts `[B, T]` of a packed batch, None for one document per row."""
        return self.node.args[9] if len(self.node.args) > 9 else self.node.kwargs.get("starts")

    def emit_core(self, emit, q, k, v, g, beta, initial_state=None, starts=None) -> fx.Node:
        """A new core call on other inputs (shapes may differ), keeping scale/chunk/backend;
        `starts` defaults to the traced core's."""
        starts = self.starts if starts is None else starts
        extra = () if starts is None else (starts,)
        return emit.core(GDN_CHUNK, q, k, v, g, beta, initial_state, self.scale, self.chunk_size, self.backend, *extra)

    def replace_pad_with(self, node: fx.Node) -> None:
        self.conv_pad.replace_all_uses_with(node)


def _feeds_conv(pad: fx.Node) -> bool:
    """The pad feeds the conv: `conv1d` itself, or (packed documents) only slices, one per tap of
    `conv_taps`."""
    users = list(pad.users)
    return any(u.target in CONV_OPS for u in users) or bool(users) and all(u.target in SLICE_OPS for u in users)


def _conv_left_pad(gm: fx.GraphModule) -> tuple[fx.Node, int]:
    pads = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in PAD_OPS and _feeds_conv(n)]
    if len(pads) != 1:
        raise CPInputError(f"expected one causal conv left-pad in a GDN layer, found {len(pads)}")
    pad = pads[0]
    left, right = pad.args[1]
    if right != 0 or left < 1:
        raise CPInputError(f"GDN conv pad {pad.args[1]} is not a causal left pad")
    return pad, left


def conv_args(conv: fx.Node) -> tuple:
    """(input, weight, bias, stride, padding, dilation, groups) of `aten.conv1d` or
    `aten.convolution` (transposed: groups reported as 0, so never depthwise)."""
    if conv.target is aten.conv1d.default:
        defaults = (None, None, None, [1], [0], [1], 1)
        args = tuple(conv.args) + defaults[len(conv.args):]
        return args[:7]
    x, w, b, stride, padding, dilation, transposed, _, groups = conv.args
    return x, w, b, stride, padding, dilation, 0 if transposed else groups


def find_gdn_cores(gm: fx.GraphModule) -> list[GdnMatch]:
    cores = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is GDN_CHUNK]
    if not cores:
        return []
    if len(cores) > 1:
        raise CPInputError(f"expected one GDN core per region, found {len(cores)}")
    pad, halo = _conv_left_pad(gm)
    return [GdnMatch(cores[0], pad, halo)]
