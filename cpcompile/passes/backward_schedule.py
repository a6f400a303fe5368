"""Async CP in the backward: the same priority order, applied to the compiled backward graph.

The backward collectives of a region (reduce-scatter of dK/dV for AllGather, the inverse
all-to-alls for Ulysses and Hybrid) are not in the region graph: autograd derives them, and
eager autograd waits for each at once. Under `torch.compile` they are nodes of the backward
graph AOT autograd hands to Inductor, each launch directly followed by its wait. Inductor runs
`config.post_grad_custom_post_pass` on that graph before it lowers it; `enable_for_groups`
installs `BackwardSchedulePass` there, and the pass re-orders a backward graph that holds a
collective on a group an asynchronous region uses with `schedule.priority_order` — the forward's
list scheduler, unchanged: each launch right after its last producer, each wait right before its
first consumer, the same rank rule (deepest chain first, then the order autograd emitted them)
and the same per-group issue order on every rank.

What differs from the forward is only what stops a chain: the forward knows its attention cores
(tagged by the rewrite); a backward graph has no tags, so any node that computes (not a view,
not a layout copy) ends a chain. Hybrid's reduce-scatter → re-layout → inverse all-to-all is a
chain; Ulysses' output exchange → attention backward → input exchanges is not.

Forward graphs (no `tangents_*` input) are left alone: the region pass ordered them already, and
Inductor keeps that order (tests/async). Eager mode never reaches this pass: its backward stays
synchronous.
"""
from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import collectives as C
from .schedule import find_collectives, group_of, is_compute, priority_order, reorder_graph

log = logging.getLogger("cpcompile")
aten = torch.ops.aten

# Copies that only change a tensor's layout: a chain of collectives runs through them.
LAYOUT_COPIES = frozenset({aten.clone.default, aten._unsafe_view.default})

# Kernels Inductor calls as they are (never fused): the cheapest nodes to pin an order to.
EXTERN_KERNELS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default})

# Process groups some asynchronous region communicates on (filled by `enable_for_groups`).
_ASYNC_GROUPS: set[str] = set()


def is_backward_graph(graph: fx.Graph) -> bool:
    """AOT autograd names the incoming gradients of a backward graph `tangents_<i>`."""
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


def mutates(node: fx.Node) -> bool:
    """An op that writes one of its arguments (a list scheduler only keeps data dependencies)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def chain_stops(graph: fx.Graph) -> set[fx.Node]:
    """The nodes a chain of collectives does not run through: every op that computes."""
    return {n for n in graph.nodes if is_compute(n) and n.target not in LAYOUT_COPIES}


@functools.cache  # once per process: every such graph is left alone for the same reason
def _warn_unscheduled() -> None:
    log.warning("cpcompile: a compiled backward graph of an async CP region holds in-place ops, whose order its "
                "data edges do not show; it keeps autograd's collective order (correct, synchronous: its "
                "collectives do not overlap compute)")


def schedule_backward(graph: fx.Graph, groups: set[str] | frozenset[str]) -> bool:
    """Order `graph` (a backward graph) for overlap if it communicates on one of `groups`; every
    collective of the graph then follows the rule, so each group keeps one issue order. Returns
    whether it re-ordered."""
    launches = [n for n in graph.nodes if n.op == "call_function" and C.is_launch(n.target)]
    if not any(group_of(n) in groups for n in launches):
        return False
    if any(mutates(n) for n in graph.nodes):  # an in-place op's order is not in the data edges
        _warn_unscheduled()
        return False
    collectives = find_collectives(graph, chain_stops(graph), {})
    reorder_graph(graph, priority_order(graph, collectives))
    pin_windows(graph, collectives)
    graph.lint()
    log.debug("cpcompile: scheduled %d backward collectives for overlap", len(collectives))
    return True


def pin_windows(graph: fx.Graph, collectives: list) -> None:
    """Make each collective's overlap window a dependency Inductor's scheduler must respect.

    Inductor re-orders its nodes afterwards to lower peak memory (`reorder_for_peak_memory`, on
    by default), and waiting at once frees a collective's input sooner, so it would take the
    windows back. With Inductor's `control_deps` ordering tool, each wait is made to follow the
    last compute nodes of its window, and the first costly node of the window (a matmul or
    another extern kernel, else the first compute node) to follow the launch. Wrapping a node
    keeps it out of fusion, which is why the launch side wraps one node only, preferably an
    extern kernel that fuses with nothing anyway."""
    try:
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
        from torch.utils._ordered_set import OrderedSet
    except ImportError:  # an Inductor without the ordering tool: the order is a request only
        log.warning("cpcompile: this torch has no control_deps; Inductor may undo the backward schedule")
        return
    position = {n: i for i, n in enumerate(graph.nodes)}
    deps: dict[fx.Node, OrderedSet] = {}
    for c in collectives:
        window = [n for n in graph.nodes if position[c.launch] < position[n] < position[c.wait] and is_compute(n)]
        if not window:
            continue
        inside = set(window)
        deps.setdefault(c.wait, OrderedSet()).update(n for n in window if not feeds_compute_in(n, inside))
        first = next((n for n in window if is_extern(n)), window[0])
        deps.setdefault(first, OrderedSet()).add(c.launch)
    try:
        preserve_node_ordering(graph, deps)
    except Exception as exc:  # a changed internal API must not break the user's compile
        log.warning("cpcompile: could not pin the backward schedule (%s); Inductor may undo it", exc)


def is_extern(node: fx.Node) -> bool:
    """Matmuls and custom ops: kernels Inductor calls as they are, never fusing into them."""
    return node.target in EXTERN_KERNELS or getattr(node.target, "namespace", "aten") != "aten"


def feeds_compute_in(node: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether a compute node of `inside` reads `node`, directly or through views."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user in inside:
            return True
        if not is_compute(user):
            stack.extend(user.users)
    return False


def unwrapped_target(node: fx.Node):
    """The op a node runs, looking inside a `control_deps` wrapper (`pin_windows`)."""
    if node.op != "call_function" or getattr(node.target, "__name__", "") != "control_deps":
        return node.target
    subgraph = getattr(node.graph.owning_module, node.args[1].target)
    (inner,) = [n for n in subgraph.graph.nodes if n.op == "call_function"]
    return inner.target


@functools.cache
def _source_digest() -> str:
    """Inductor's FX-graph cache keys a custom pass by its uuid: the code that decides the order."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in ("backward_schedule.py", "schedule.py"):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


class BackwardSchedulePass(CustomGraphPass):
    """Inductor's post-grad hook: schedule backward graphs that talk on an async region's groups."""

    def __call__(self, graph: fx.Graph) -> None:
        if is_backward_graph(graph):
            schedule_backward(graph, _ASYNC_GROUPS)

    def uuid(self) -> str:
        return f"cpcompile-backward-schedule-{_source_digest()}-{','.join(sorted(_ASYNC_GROUPS))}"


class _Both(CustomGraphPass):
    """A post-grad pass the user had installed, then cpcompile's."""

    def __init__(self, first, then: BackwardSchedulePass):
        self.first, self.then = first, then

    def __call__(self, graph: fx.Graph) -> None:
        self.first(graph)
        self.then(graph)

    def uuid(self):
        first = self.first.uuid() if hasattr(self.first, "uuid") else None
        return None if first is None else (first, self.then.uuid())  # None: Inductor does not cache


SCHEDULE = BackwardSchedulePass()


def installed(hook) -> bool:
    return hook is SCHEDULE or (isinstance(hook, _Both) and hook.then is SCHEDULE) or (
        isinstance(hook, (list, tuple)) and SCHEDULE in hook)


def enable_for_groups(group_names) -> None:
    """Schedule, under `torch.compile` with Inductor, the backward collectives on these groups.

    Installs the pass in `torch._inductor.config.post_grad_custom_post_pass` once per process,
    after any pass already there (a user's own pass keeps running first)."""
    import torch._inductor.config as inductor_config

    _ASYNC_GROUPS.update(group_names)
    hook = inductor_config.post_grad_custom_post_pass
    if installed(hook):
        return
    if hook is None:
        inductor_config.post_grad_custom_post_pass = SCHEDULE
    elif isinstance(hook, list):  # newer torch accepts a list of passes
        inductor_config.post_grad_custom_post_pass = [*hook, SCHEDULE]
    else:
        inductor_config.post_grad_custom_post_pass = _Both(hook, SCHEDULE)
