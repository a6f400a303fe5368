"""Ops inside a captured region that read the local sequence length, found by tracing it symbolically.

A region is traced with the shapes of one rank's call, so its graph holds that rank's length as a
plain number wherever the module's code read it: `arange(hidden_states.shape[1])` (Llama-4's
attention temperature tuning), a tensor sized by it, a reduction over the sequence, arithmetic
with `shape[1]`. Under CP each of those means the shard where the single process meant the
whole sequence — silently wrong. In the region's graph such a number cannot be told from any
other (a head size of the same value), so the region is traced a second time with the sequence
dimension of its inputs symbolic (`torch.export` with `Dim.AUTO`): there every op that reads the
length takes a symbol, and `find_local_length_reads` lists them, each with its source line.
`passes/local_length.py` then rewrites the ones with a global meaning (`arange` of the length:
the tokens' global positions) and refuses the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.export import Dim
from torch.fx.operator_schemas import normalize_function
from torch.utils import _pytree as pytree

from ..capture import trace_region
from ..errors import UnsupportedError

aten = torch.ops.aten

# tensors whose values count along their length: sized by the local length, they hold local positions
COUNTING = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step, aten.linspace.default})
# tensors whose size is all they take from it (a per-token buffer or constant): only a fill value
# computed from the length reads it
SIZED = frozenset({
    aten.ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format, aten.new_ones.default,
    aten.new_zeros.default, aten.new_full.default, aten.new_empty.default, aten.rand.default, aten.randn.default,
    aten.empty_strided.default, aten.new_empty_strided.default,
})
# ops that take the length only to lay out the same data (a view of [B, S, H] as [B, S, heads, D])
LAYOUT = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default, aten.slice.Tensor,
    aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default, aten.as_strided.default,
    aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default,
})
# ops that combine the tokens along a dimension (`dim` argument; None: every dimension)
ALONG_DIM = frozenset({
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default, aten.amin.default,
    aten.max.dim, aten.min.dim, aten.prod.dim_int, aten.var.correction, aten.std.correction, aten.logsumexp.default,
    aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default, aten.argmax.default, aten.argmin.default,
    aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int, aten.cumsum.default,
    aten.cumprod.default, aten.logcumsumexp.default, aten.sort.default, aten.topk.default, aten.argsort.default,
    aten.flip.default, aten.roll.default, aten.any.dim, aten.all.dim,
})
CONTRACTIONS = frozenset({aten.mm.default, aten.bmm.default, aten.matmul.default, aten.linear.default})
CORES = frozenset({aten.scaled_dot_product_attention.default})  # the core mixes the sequence by design


@dataclass(frozen=True)
class LengthRead:
    """One op of the region reading the local length: its op, which of the region's calls of that
    op it is (`occurrence`, counted in graph order, so it can be found in the region's own graph),
    what it does with the length, its source line, and whether it is `arange(length)`, the one
    read with a global meaning (the tokens' positions)."""

    target: object
    occurrence: int
    what: str
    source: str
    node: str
    positions: bool = False

    def describe(self) -> str:
        return f"{self.node} ({self.what}) at {self.source}"


def find_local_length_reads(module, forward, args: tuple, kwargs: dict, batch: int, length: int) -> list[LengthRead]:
    """Trace `forward(module, *args, **kwargs)` with the sequence dimension (dim 1 of the inputs laid out
    `[B, S, ...]`, `batch` rows of `length` tokens) symbolic, and list the ops that read it."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def call(target, *tensors):  # export takes tensors only: every other leaf stays a constant of the call
        full = list(leaves)
        for i, tensor in zip(where, tensors):
            full[i] = tensor
        call_args, call_kwargs = pytree.tree_unflatten(full, spec)
        return forward(target, *call_args, **call_kwargs)

    tensors = tuple(leaves[i] for i in where)
    dims = tuple({d: Dim.AUTO for d in marked} if (marked := sequence_dims(t, batch, length)) else None
                 for t in tensors)
    ep = trace_region(module, call, tensors, {}, dynamic_shapes={"args": dims})
    symbols, fixed = sequence_symbols(ep.graph_module, dims)
    if fixed or not symbols:
        raise UnsupportedError(
            f"{type(module).__name__}: tracing the region with its sequence length symbolic fixed that length "
            "(the module's code branches on it or needs its value), so cpcompile cannot check which ops read the "
            "local length, each of which would read one rank's slice under CP")
    return reads_of(ep.graph_module, symbols)


def sequence_dims(tensor: torch.Tensor, batch: int, length: int) -> tuple[int, ...]:
    """The sequence dimensions of a region input: the last two of a `[B, 1 or heads, S, S]` mask,
    else dim 1 of a tensor laid out `[B or 1, S, ...]`."""
    if tensor.dim() == 4 and tensor.shape[0] in (batch, 1) and tuple(tensor.shape[2:]) == (length, length):
        return (2, 3)
    if tensor.dim() >= 2 and tensor.shape[0] in (batch, 1) and tensor.shape[1] == length:
        return (1,)
    return ()


def sequence_symbols(gm: fx.GraphModule, dims: tuple) -> tuple[set, bool]:
    """The symbols the trace gave the marked sequence dimensions of the inputs, and whether it
    fixed any of them to a number instead."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    user = placeholders[len(placeholders) - len(dims):]  # parameters and buffers come first
    symbols, fixed = set(), False
    for node, marked in zip(user, dims):
        for dim in marked or ():
            size = node.meta["val"].shape[dim]
            if isinstance(size, torch.SymInt):
                symbols |= size.node.expr.free_symbols
            else:
                fixed = True
    return symbols, fixed


def reads_of(gm: fx.GraphModule, symbols: set) -> list[LengthRead]:
    counts: dict[object, int] = {}
    reads = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        occurrence = counts.get(node.target, 0)
        counts[node.target] = occurrence + 1
        what = length_use(node, symbols)
        if what is not None:
            reads.append(LengthRead(node.target, occurrence, what, source_line(node), node.name,
                                    positions=is_positions(node, symbols)))
    return reads


def length_use(node: fx.Node, symbols: set) -> str | None:
    """What `node` does with the local length, or None if it does not read it."""
    if node.target in CORES:
        return None
    scalars = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if reads(a, symbols)]
    if node.target in COUNTING and scalars:
        return "positions counted along the local length"
    if node.target in SIZED:
        normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        fill = [v for k, v in (normalized.kwargs if normalized else {}).items() if k not in ("size", "stride")]
        return "a fill value computed from the local length" if any(reads(v, symbols) for v in fill) else None
    shape = node.args[0].meta["val"].shape if node.args and isinstance(node.args[0], fx.Node) else ()
    if node.target in ALONG_DIM:
        if any(reads(shape[d], symbols) for d in reduced_dims(node) if -len(shape) <= d < len(shape)):
            return "a reduction or scan over the local sequence"
    if node.target in CONTRACTIONS and shape and reads(shape[-1], symbols):
        return "a product contracting the local sequence"
    if scalars and node.target not in LAYOUT:
        return "arithmetic with the local length"
    return None


def reduced_dims(node: fx.Node) -> list[int]:
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    kwargs = normalized.kwargs if normalized is not None else {}
    dim = kwargs.get("dim")
    rank = node.args[0].meta["val"].dim() if isinstance(node.args[0], fx.Node) else 0
    if dim is None or dim == []:
        return list(range(rank))
    return list(dim) if isinstance(dim, (list, tuple)) else [dim]


def reads(value, symbols: set) -> bool:
    """Whether `value` (a node's argument, or a size) depends on one of `symbols`."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return bool(value.node.expr.free_symbols & symbols)
    return False


def is_positions(node: fx.Node, symbols: set) -> bool:
    """`arange(S)` / `arange(0, S)` / `arange(0, S, 1)` with S exactly the local length."""
    if node.target is aten.arange.default:
        start, end, step = 0, node.args[0], 1
    elif node.target is aten.arange.start:
        (start, end), step = node.args[:2], 1
    elif node.target is aten.arange.start_step:
        start, end, step = node.args[:3]
    else:
        return False
    end = end.meta.get("val") if isinstance(end, fx.Node) else end
    return start == 0 and step == 1 and isinstance(end, torch.SymInt) and end.node.expr in symbols


def source_line(node: fx.Node) -> str:
    """`file:line (code)` of the user code that made `node`, from its stack trace."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    if not frames:
        return "<unknown source>"
    code = trace[-1].strip() if not trace[-1].strip().startswith("File ") else ""
    return f"{frames[-1].removeprefix('File ')}" + (f": {code}" if code else "")

