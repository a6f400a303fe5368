"""A rewritten region and how it is called in place of the module's forward."""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from .capture import PREFIX
from .collectives import runnable_graph
from .errors import CPConfigError, UnsupportedError
from .tp import live_local

log = logging.getLogger("cpcompile")

# Non-tensor call arguments a traced graph may be specialised on (by value).
PLAIN_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device)

# Traced graphs kept per region (`compile(trace_cache_size=)`, else this variable, else the default):
# each new sequence length traces every region again, and a graph holds its own copy of the
# region's code and metadata, so a job feeding ever new lengths must not keep them all.
TRACE_CACHE_ENV = "CPCOMPILE_TRACE_CACHE_SIZE"
DEFAULT_TRACE_CACHE_SIZE = 8
# A region traced for more signatures than this is re-tracing as a habit: warn (once per model).
WARN_AFTER_TRACES = 4
# Call arguments that may differ between the ranks of one batch at the same step: transformers
# passes the attention mask on a rank whose shard has padding and None on one without.
RANK_LOCAL_KWARGS = frozenset({"attention_mask"})


def flatten_call(fqn: str, args: tuple, kwargs: dict) -> tuple[list[Any], tuple]:
    """The call's leaves, and the key a traced graph is specialised on: the structure, each
    tensor's shape/dtype/device, each other leaf's value and the autocast state. Anything else
    cannot be keyed reliably, so it is refused rather than traced again on every call.

    The key is plain tuples, strings and numbers, so that `torch.compile` can trace the lookup of
    a region's graph by it (Dynamo cannot hash pytree's `TreeSpec`)."""
    call = (tuple(args), dict(kwargs))
    leaves = pytree.tree_leaves(call)
    described = []
    for leaf in leaves:
        key = leaf_key(leaf)
        if key is None:
            raise TypeError(f"{fqn}: a CP region cannot take an argument of type {type(leaf).__name__}; "
                            "pass tensors and plain values (int, float, bool, str, None)")
        described.append(key)
    return leaves, (call_structure(call), tuple(described), autocast_state(leaves))


def leaf_key(leaf: Any) -> tuple | None:
    """How one leaf of a call enters its signature: a tensor by its shape, dtype and device, a plain
    value by itself; None for anything else."""
    if isinstance(leaf, torch.Tensor):
        return "tensor", tuple(leaf.shape), leaf.dtype, leaf.device
    if isinstance(leaf, PLAIN_VALUES):
        return type_name(type(leaf)), leaf
    return None


@torch.compiler.assume_constant_result
def type_name(kind: type) -> str:
    """`kind.__name__`, which Dynamo takes as a constant here: torch 2.11's Dynamo cannot hash a
    type's `__name__` read in traced code, and a region's key holds them (a graph break there,
    inside a checkpointed layer, ran every compiled CP layer eagerly)."""
    return kind.__name__


def call_structure(tree: Any) -> Any:
    """How a call nests its containers, as a hashable value: `(type name, children)` for tuples,
    lists and dicts (with their keys), the type's name for anything else (a leaf, or a container
    type registered with pytree, whose leaves the key describes one by one)."""
    if isinstance(tree, (tuple, list)):
        return type_name(type(tree)), tuple(call_structure(child) for child in tree)
    if isinstance(tree, dict):
        return type_name(type(tree)), tuple((name, call_structure(child)) for name, child in tree.items())
    return type_name(type(tree))


def autocast_state(leaves: list[Any]) -> tuple:
    """Whether autocast is on, and to which dtype, for each device type the call's tensors are on.

    A traced graph holds the dtypes it was traced with (it checks them as it runs), so a call
    under autocast must not run a graph traced outside it, nor the reverse: the state is part of
    the signature, and a call under a new state traces the region again, under that state."""
    devices = sorted({leaf.device.type for leaf in leaves if isinstance(leaf, torch.Tensor)})
    return tuple((d, torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None) for d in devices)


def describe_call(args: tuple, kwargs: dict) -> list[str]:
    """The call as readable text, one entry per leaf: `hidden_states: float32[1, 8, 32]`,
    `use_cache=False` (positional arguments are `arg0`, `arg1`, ...)."""
    described = []
    for path, leaf in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        where, rest = path[1], pytree.keystr(path[2:])
        name = (f"arg{where.idx}" if path[0].idx == 0 else str(where.key)) + rest
        if isinstance(leaf, torch.Tensor):
            described.append(f"{name}: {str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}")
        else:
            described.append(f"{name}={leaf!r}")
    return described


def shared_signature(args: tuple, kwargs: dict) -> tuple[str, ...]:
    """What every rank of the cp group calls a region with at the same step, as text: the call
    without its rank-local arguments, and the autocast state."""
    shared = {name: value for name, value in kwargs.items() if name not in RANK_LOCAL_KWARGS}
    leaves = pytree.tree_leaves((tuple(args), shared))
    autocast = ", ".join(f"{device} autocast {dtype}" for device, dtype in autocast_state(leaves) if dtype is not None)
    return (*describe_call(args, shared), autocast or "no autocast")


@dataclass
class RetracePolicy:
    """What every region of one compiled model keeps and says about re-tracing: `cache_size`
    graphs each (least recently used dropped first), and one WARNING for the whole model when a
    region has traced more than `WARN_AFTER_TRACES` signatures (every region re-traces alike)."""

    cache_size: int
    warned: bool = False

    @classmethod
    def resolve(cls, requested: int | None) -> "RetracePolicy":
        size = requested if requested is not None else os.environ.get(TRACE_CACHE_ENV, DEFAULT_TRACE_CACHE_SIZE)
        if isinstance(size, str) and size.strip().isdigit():
            size = int(size)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise CPConfigError(f"trace_cache_size (or {TRACE_CACHE_ENV}) must be a positive integer, got {size!r}")
        return cls(size)

    def note_trace(self, fqn: str, traces: int, call: list[str]) -> None:
        """Log one more traced signature of region `fqn` (its `traces`-th)."""
        if traces > 1:
            log.info("cpcompile: %s traced again for a new input signature (%d so far): %s", fqn, traces, ", ".join(call))
        if traces > WARN_AFTER_TRACES and not self.warned:
            self.warned = True
            log.warning(
                "cpcompile: %s has been traced for %d input signatures (latest: %s). Every new sequence length, "
                "batch size, dtype or autocast state traces each region again, and each keeps only the %d most "
                "recent graphs (trace_cache_size= of compile, or %s): pad batches to a few lengths "
                "(docs/batch.md, 'A few lengths'). Logged once.",
                fqn, traces, ", ".join(call), self.cache_size, TRACE_CACHE_ENV,
            )


# Runnable graphs by what they compute (`graph_identity`), shared by the regions whose graphs are
# alike: the layers of one kind (their parameters are inputs), so that `torch.compile` meets one
# graph object, not one a layer (Dynamo guards on its class, and fx makes a class per graph).
_RUNNABLES: "weakref.WeakValueDictionary[tuple, fx.GraphModule]" = weakref.WeakValueDictionary()


def graph_identity(gm: fx.GraphModule) -> tuple | None:
    """What a graph computes from its inputs: its code and the objects the code's names stand for;
    None for a graph reading attributes or submodules of its own, or generated by another codegen than
    fx's plain one (a pytree codegen reads its specs off the module): those may differ between alike code."""
    if type(gm.graph._codegen) is not fx.graph.CodeGen or \
            any(node.op in ("get_attr", "call_module") for node in gm.graph.nodes):
        return None
    code = gm.graph.python_code(root_module="self")
    return code.src, tuple(sorted((name, id(value)) for name, value in code.globals.items()))


def shared_runnable(gm: fx.GraphModule) -> fx.GraphModule:
    """The runnable graph alike to `gm` made before (by any region), else `gm`, kept for the next."""
    identity = graph_identity(gm)
    if identity is None:
        return gm
    return _RUNNABLES.setdefault(identity, gm)


@dataclass
class RegionProgram:
    """A rewritten graph plus what it takes to call it with the live module's state.

    `state` lists, for each leading placeholder, where its value lives at call time: an
    (owning submodule, attribute name) pair read on every call — so a later FSDP2
    `fully_shard`, which swaps parameters on their modules, still works — or a constant.
    `tp_state` holds the indices of tensor-parallel parameters, which the graph was traced with
    as local shards (`tp.py`): it takes their `to_local()`.

    `gm` is the graph the passes rewrite, the dump shows and tests read; a call runs `runnable`,
    its copy with compiler-visible collective launches (`collectives.runnable_graph`), made
    whenever `gm` is set, and one object for alike regions (`shared_runnable`).
    """

    gm: fx.GraphModule
    state: list[tuple[nn.Module, str] | torch.Tensor]
    out_spec: pytree.TreeSpec
    fqn: str = ""
    tp_state: frozenset[int] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "gm":
            super().__setattr__("runnable", shared_runnable(runnable_graph(value)))

    @classmethod
    def from_export(cls, ep: torch.export.ExportedProgram, module: nn.Module, fqn: str = "",
                    tp_modules: frozenset[nn.Module] = frozenset()) -> "RegionProgram":
        state = []
        for spec in ep.graph_signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                continue
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                owner, _, attr = spec.target[len(PREFIX):].rpartition(".")
                state.append((module.get_submodule(owner), attr))
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                state.append(ep.constants[spec.target])
            else:
                raise UnsupportedError(f"unsupported exported input kind {spec.kind}")
        tp_state = frozenset(i for i, ref in enumerate(state) if isinstance(ref, tuple) and ref[0] in tp_modules)
        return cls(ep.graph_module, state, ep.call_spec.out_spec, fqn, tp_state)

    def flat_inputs(self, leaves: list[Any]) -> list[Any]:
        live = [live_local(getattr(*ref), self.fqn, ref[1], i in self.tp_state) if isinstance(ref, tuple) else ref
                for i, ref in enumerate(self.state)]
        return live + list(leaves)

    def __call__(self, leaves: list[Any]) -> Any:
        return pytree.tree_unflatten(self.runnable(*self.flat_inputs(leaves)), self.out_spec)
