"""The collective ops that rewrite passes put into graphs, kept in one place.

Passes emit *visible* functional collectives: a launch node (an op from the
`_c10d_functional_autograd` namespace, which carries its own backward: all-gather ↔
reduce-scatter, all-to-all ↔ inverse all-to-all) followed by a `wait_tensor` node. The
autograd entry points moved between torch releases (2.13 gave the plain `_c10d_functional`
ops autograd and kept these as compatibility names); the `_c10d_functional_autograd`
names exist in every release we support (torch>=2.11), so only this module names them.

A region *runs* another copy of its graph (`runnable_graph`), whose launches are plain
`_c10d_functional` ops under an autograd function of ours: AOT autograd's partitioner knows only
that namespace as collectives. The autograd namespace it takes for ordinary ops, and under
`torch.compile` it then copies forward collectives into the backward graph to recompute them:
communication twice, and in an order that follows each rank's own graph, so ranks whose graphs
differ (one traced a region again, for its own padding mask) wait on each other's collectives.
"""
from __future__ import annotations

import os

import torch
import torch.fx as fx

_funcol_autograd = torch.ops._c10d_functional_autograd
_funcol = torch.ops._c10d_functional

ALL_GATHER = _funcol_autograd.all_gather_into_tensor.default
ALL_TO_ALL = _funcol_autograd.all_to_all_single.default
REDUCE_SCATTER = _funcol_autograd.reduce_scatter_tensor.default
WAIT = _funcol.wait_tensor.default
ALL_REDUCE = _funcol.all_reduce.default  # no autograd: only integer bookkeeping (rope.py) reduces

LAUNCH_OPS = frozenset({ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER})

# Collective ops as they may appear after tracing / AOT autograd (backward graphs use the
# non-autograd names). Used by structure checks and the dump, never for emitting.
_KNOWN_LAUNCH_NAMES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_reduce",
)


def is_launch(target: object) -> bool:
    """True for a functional-collective launch op, autograd or not."""
    name = getattr(target, "__name__", "") or ""
    namespace = getattr(target, "namespace", "") or ""
    return namespace in ("_c10d_functional", "_c10d_functional_autograd") and any(
        name.startswith(known) for known in _KNOWN_LAUNCH_NAMES
    )


def is_wait(target: object) -> bool:
    return getattr(target, "namespace", "") == "_c10d_functional" and (
        getattr(target, "__name__", "") or ""
    ).startswith("wait_tensor")


def collective_kind(target: object) -> str:
    """Short name of a launch op: 'all_gather_into_tensor', 'all_to_all_single', …"""
    name = getattr(target, "__name__", "")
    return name.split(".")[0]


# --- the layout a collective's backward receives ----------------------------------------------
#
# A launch's autograd backward (reduce-scatter for an all-gather, the inverse all-to-all) runs on
# the gradient of its wait's output, whatever layout the consumers produced: a permuted view
# after the re-layout that follows every collective here, or a transposed gradient from a CUDA
# attention kernel. gloo copies such a tensor silently; NCCL refuses it ("Expected
# input.is_contiguous()"), and torch releases before 2.13 do not copy it first. So every waited
# collective passes through `contiguous_gradient` before anything consumes it.


class _ContiguousGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_gradient(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; backward hands a contiguous gradient to the collective before it."""
    return _ContiguousGradient.apply(x)


class NonContiguousCollectiveGradient(RuntimeError):
    """`CPCOMPILE_STRICT_COLLECTIVES=1`: a collective's backward would get a non-contiguous tensor."""


class _CheckGradientLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, what):
        ctx.what = what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if not grad.is_contiguous():
            raise NonContiguousCollectiveGradient(
                f"the backward of {ctx.what} would receive a non-contiguous gradient (shape {tuple(grad.shape)}, "
                f"strides {grad.stride()}); NCCL refuses that (Expected input.is_contiguous())")
        return grad, None


def check_gradient_layout(x: torch.Tensor, what: str) -> torch.Tensor:
    """Identity forward; backward raises if the gradient reaching a collective is not contiguous.

    Emitted only under `CPCOMPILE_STRICT_COLLECTIVES=1` (the test suite sets it), between a wait
    and its `contiguous_gradient`: it makes gloo as strict as NCCL about the collective's backward.
    """
    return _CheckGradientLayout.apply(x, what)


def strict_collectives() -> bool:
    return os.environ.get("CPCOMPILE_STRICT_COLLECTIVES", "") == "1"


# --- the runnable copy: plain launches under autograd functions the partitioner sees through ------


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_size, group_name):
        ctx.group = group_size, group_name
        return _funcol.all_gather_into_tensor(x, group_size, group_name)

    @staticmethod
    def backward(ctx, grad):
        size, name = ctx.group
        return WAIT(_funcol.reduce_scatter_tensor(grad.contiguous(), "sum", size, name)), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, reduce_op, group_size, group_name):
        if reduce_op.lower() != "sum":
            raise NotImplementedError(f"reduce-scatter with {reduce_op!r}: only 'sum' has a gradient here")
        ctx.group = group_size, group_name
        return _funcol.reduce_scatter_tensor(x, reduce_op, group_size, group_name)

    @staticmethod
    def backward(ctx, grad):
        size, name = ctx.group
        return WAIT(_funcol.all_gather_into_tensor(grad.contiguous(), size, name)), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group_name):
        ctx.exchange = output_split_sizes, input_split_sizes, group_name
        return _funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, group_name)

    @staticmethod
    def backward(ctx, grad):
        received, sent, name = ctx.exchange  # the inverse exchange: what came in goes back
        return WAIT(_funcol.all_to_all_single(grad.contiguous(), sent, received, name)), None, None, None


def all_gather_launch(x, group_size, group_name):
    return _AllGather.apply(x, group_size, group_name)


def reduce_scatter_launch(x, reduce_op, group_size, group_name):
    return _ReduceScatter.apply(x, reduce_op, group_size, group_name)


def all_to_all_launch(x, output_split_sizes, input_split_sizes, group_name):
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group_name)


RUNNABLE_LAUNCHES = {ALL_GATHER: all_gather_launch, REDUCE_SCATTER: reduce_scatter_launch,
                     ALL_TO_ALL: all_to_all_launch}


def runnable_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` that launches its collectives as plain `_c10d_functional` ops, each under an
    autograd function with the same backward (the module docstring says why). Same arguments,
    same order, same launch/wait split: only the op each launch node calls differs."""
    graph = fx.Graph()
    graph.set_codegen(gm.graph._codegen)
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in RUNNABLE_LAUNCHES:
            node.target = RUNNABLE_LAUNCHES[node.target]
    return fx.GraphModule(gm, graph)
