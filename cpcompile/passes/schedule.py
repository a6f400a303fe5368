"""Async CP: one topological order of the region, chosen by a priority rule.

The rewrites emit each collective as a launch node directly followed by its wait (a
synchronous collective). For an asynchronous method this pass re-orders the whole region
with a single list scheduler (Thunder-style: one topological sort, a priority selector),
so that every launch sits right after its last producer, every wait right before its first
consumer, and the model's independent compute (typically the Q path) runs in between.

Priority, highest first, among the nodes whose inputs are all placed:

1. a launch whose process group has issued every collective ranked before it;
2. a *hop*: a node after a wait that feeds another launch (Hybrid's A2A → reshape →
   AllGather), so a chain moves to its next collective at once;
3. a chain wait (its result feeds another collective) once every collective of its chain
   stage or a deeper one is issued and some model compute has run under it — a pipeline:
   Hybrid's A2A of K hides the V path, the AllGather of K then hides the Q path;
4. producers of collective inputs, those of the highest-ranked collective first;
5. independent compute, in the traced order;
6. consumers of waits, in the traced order;
7. any other wait, the earliest launch first — taken only when nothing else can run.

Collectives are ranked by (deepest chain first, emission order). Both are functions of the
collectives the rewrite emitted, which the rewrites keep identical on every rank; nothing
rank-specific (a mask present on one rank only changes producers, never collectives) enters
the rank, and rule 1 makes each process group issue in rank order. So every rank issues the
same collectives in the same order on each group.

The pass then verifies the result (`check_overlap`): an asynchronous collective with no
compute between its launch and its wait, or an attention whose collectives hide none of the
model's own compute, is a compile-time error — a launch followed by its wait is not async.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .. import collectives as C
from ..context import PassContext
from ..errors import CPInputError
from ..methods import method_spec
from .graph_utils import ancestors, descendants, is_core

# Static priority classes of ordinary nodes (rules 2, 4, 5, 6 of the module docstring; lower runs
# first). Launches and waits are chosen outside this order: whether one may go depends on what
# has been placed already (the group's turn, the chain stage), so it is decided at each step.
HOP, PRODUCER, INDEPENDENT, CONSUMER = range(4)


@dataclass(eq=False)
class Collective:
    """One launch/wait pair of the region and where it stands in the collective order."""

    launch: fx.Node
    wait: fx.Node
    group: str
    index: int                  # emission order: position among the launches of the rewritten graph
    depth: int = 1              # collectives on the longest chain starting here (A2A → AllGather: 2)
    chained: bool = False       # its wait feeds another collective without passing a core
    cores: frozenset = frozenset()  # the attention cores it feeds (none: produced from one)
    purpose: str = ""

    @property
    def is_input(self) -> bool:
        return bool(self.cores)

    @property
    def rank(self) -> tuple[int, int]:
        return (-self.depth, self.index)

    def describe(self) -> str:
        kind = C.collective_kind(self.launch.target)
        return f"{kind}({self.purpose}) {self.launch.name} -> {self.wait.name}"


def schedule_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Asynchronous methods: order the region for overlap and verify it; others: unchanged."""
    if not ctx.method.asynchronous:
        return gm
    gm.graph.eliminate_dead_code()  # nodes the rewrite left unused must not pass for overlapped work
    cores = {node for node in gm.graph.nodes if is_core(node)}
    collectives = find_collectives(gm.graph, cores, {c.launch: c.purpose for c in ctx.collectives})
    order = priority_order(gm.graph, collectives)
    reorder_graph(gm.graph, order)
    gm.graph.lint()
    gm.recompile()
    check_overlap(gm, collectives, cores, ctx)
    return gm


# --- the collectives and their ranks ------------------------------------------------------------


def find_collectives(graph: fx.Graph, cores: set[fx.Node], purposes: dict[str, str]) -> list[Collective]:
    """Every launch of `graph` with its wait, ranked. `cores` are the nodes a chain of
    collectives stops at (see `reach_from`); `purposes` names launches for messages and the dump.
    A launch that is not waited (or whose result is read elsewhere too) is not scheduled: it stays
    an ordinary node, placed by the static priorities."""
    collectives = []
    for node in graph.nodes:
        if node.op == "call_function" and C.is_launch(node.target):
            users = list(node.users)
            if len(users) != 1 or not C.is_wait(users[0].target):
                continue
            collectives.append(Collective(node, users[0], group_of(node), len(collectives),
                                          purpose=purposes.get(node.name, "")))
    by_launch = {c.launch: c for c in collectives}
    successors = {}
    for c in collectives:
        reached_launches, c.cores = reach_from(c.wait, cores)
        c.chained = bool(reached_launches)
        successors[c] = [by_launch[n] for n in reached_launches if n in by_launch]
    # a successor is downstream of its predecessor's wait, so it was emitted later: go backwards
    for c in reversed(collectives):
        c.depth = 1 + max((n.depth for n in successors[c]), default=0)
    return collectives


def group_of(launch: fx.Node) -> str:
    """The process-group name a functional-collective launch runs on (its `group_name` argument)."""
    names = [a.name for a in launch.target._schema.arguments]
    index = names.index("group_name")
    return launch.kwargs["group_name"] if "group_name" in launch.kwargs else launch.args[index]


def reach_from(wait: fx.Node, cores: set[fx.Node]) -> tuple[set[fx.Node], frozenset[fx.Node]]:
    """Launches reachable from `wait` without passing through a core, and the cores reached
    (directly or through those launches).

    A collective whose wait leads to another launch only through an attention core (Ulysses'
    input exchange → attention → output exchange) is not a chain: the core is its consumer.
    """
    launches, reached_cores, seen = set(), set(), set()
    stack = list(wait.users)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in cores:
            reached_cores.add(node)
            continue
        if node.op == "call_function" and C.is_launch(node.target):
            launches.add(node)  # and on through it: the chain's last collective feeds the core
        stack.extend(node.users)
    return launches, frozenset(reached_cores)


def node_positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


# --- the list scheduler -------------------------------------------------------------------------


@dataclass
class _Scheduler:
    """State of one priority-driven topological sort of a region graph."""

    graph: fx.Graph
    collectives: list[Collective]
    order: list[fx.Node] = field(default_factory=list)

    def __post_init__(self):
        self.position = node_positions(self.graph)
        self.of_launch = {c.launch: c for c in self.collectives}
        self.of_wait = {c.wait: c for c in self.collectives}
        self.static_priority = self._static_priorities()
        self.missing = {n: len(set(n.all_input_nodes)) for n in self.graph.nodes}
        self.issued: set[Collective] = set()
        self.model_compute_since: dict[Collective, int] = {}
        self.ready_heap: list[tuple] = []
        self.ready_launches: list[Collective] = []
        self.ready_waits: list[Collective] = []
        self.by_group: dict[str, list[Collective]] = {}
        for c in sorted(self.collectives, key=lambda c: c.rank):
            self.by_group.setdefault(c.group, []).append(c)

    def _static_priorities(self) -> dict[fx.Node, tuple]:
        """Priority of every node that is neither a launch nor a wait (those are dynamic)."""
        feeds: dict[fx.Node, tuple[int, int]] = {}
        for c in self.collectives:  # each node remembers the best-ranked launch it feeds
            for node in ancestors(c.launch):
                if node not in feeds or c.rank < feeds[node]:
                    feeds[node] = c.rank
        after_wait: set[fx.Node] = set()
        for c in self.collectives:
            after_wait |= descendants(c.wait)
        priority = {}
        for node in self.graph.nodes:
            pos = self.position[node]
            if node in feeds and node in after_wait:
                priority[node] = (HOP, pos)
            elif node in feeds:
                priority[node] = (PRODUCER, *feeds[node], pos)
            elif node in after_wait:
                priority[node] = (CONSUMER, pos)
            else:
                priority[node] = (INDEPENDENT, pos)
        return priority

    def run(self) -> list[fx.Node]:
        for node in self.graph.nodes:
            if self.missing[node] == 0:
                self._make_ready(node)
        while True:
            node = self._select()
            if node is None:
                break
            self._place(node)
        if len(self.order) != len(self.missing):
            raise AssertionError("schedule_pass: the priority order left nodes unplaced (cycle?)")
        return self.order

    def _make_ready(self, node: fx.Node) -> None:
        if node in self.of_launch:
            self.ready_launches.append(self.of_launch[node])
        elif node in self.of_wait:
            self.ready_waits.append(self.of_wait[node])
        else:
            heapq.heappush(self.ready_heap, (self.static_priority[node], node))  # priorities are unique

    def _select(self) -> fx.Node | None:
        issuable = [c for c in self.ready_launches if self._turn_of(c)]
        if issuable:
            chosen = min(issuable, key=lambda c: c.rank)
            self.ready_launches.remove(chosen)
            return chosen.launch
        if self.ready_heap and self.ready_heap[0][0][0] == HOP:
            return heapq.heappop(self.ready_heap)[1]
        pipelined = [c for c in self.ready_waits if self._chain_wait_due(c)]
        if pipelined:
            return self._take_wait(min(pipelined, key=lambda c: c.rank))
        if self.ready_heap:
            return heapq.heappop(self.ready_heap)[1]
        if self.ready_waits:
            return self._take_wait(min(self.ready_waits, key=lambda c: c.index))
        return None

    def _turn_of(self, c: Collective) -> bool:
        """A group issues its collectives in rank order, the same on every rank."""
        queue = self.by_group[c.group]
        return all(earlier in self.issued for earlier in queue[: queue.index(c)])

    def _chain_wait_due(self, c: Collective) -> bool:
        stage_issued = all(other in self.issued for other in self.collectives if other.depth >= c.depth)
        return c.chained and stage_issued and self.model_compute_since[c] > 0

    def _take_wait(self, c: Collective) -> fx.Node:
        self.ready_waits.remove(c)
        return c.wait

    def _place(self, node: fx.Node) -> None:
        self.order.append(node)
        if node in self.of_launch:
            c = self.of_launch[node]
            self.issued.add(c)
            self.model_compute_since[c] = 0
        elif is_model_compute(node):
            for c in self.model_compute_since:
                self.model_compute_since[c] += 1
        for user in node.users:
            self.missing[user] -= 1
            if self.missing[user] == 0:
                self._make_ready(user)


def priority_order(graph: fx.Graph, collectives: list[Collective]) -> list[fx.Node]:
    return _Scheduler(graph, collectives).run()


def reorder_graph(graph: fx.Graph, order: list[fx.Node]) -> None:
    """Move the nodes into `order`; placeholders stay first and the output last (FX rules)."""
    body = [n for n in order if n.op not in ("placeholder", "output")]
    cursor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for node in body:
        cursor.append(node)
        cursor = node


# --- what counts as compute, and the verification ------------------------------------------------


def is_compute(node: fx.Node) -> bool:
    """An op that produces new data: not a view/alias, not a collective, not an assertion."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if C.is_launch(target) or C.is_wait(target):
        return False
    returns = target._schema.returns
    return bool(returns) and all(r.alias_info is None for r in returns)


def is_model_compute(node: fx.Node) -> bool:
    """Compute the model itself does, as opposed to what a CP pass emitted (layout copies,
    mask rebuilding): only this is work that communication can usefully hide behind."""
    return is_compute(node) and "cpcompile_pass" not in node.meta


def nodes_between(order: dict[fx.Node, int], nodes: list[fx.Node], c: Collective) -> list[fx.Node]:
    return nodes[order[c.launch] + 1: order[c.wait]]


def check_overlap(gm: fx.GraphModule, collectives: list[Collective], cores: set[fx.Node], ctx: PassContext) -> None:
    """Refuse an async region whose collectives hide nothing; note the ones that cannot.

    Each core's collectives together must hide some of the model's own compute (not only the
    rewrite's layout copies), and every collective feeding it must have compute between its
    launch and its wait — except the last one launched: once every input of the core is in
    flight, nothing independent may be left (Ulysses: the Q, K and V exchanges hide each other's
    projections, the last one nothing). It and a collective produced *from* a core (Ulysses'
    output exchange) are noted, not refused.
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    method = f"{ctx.method.describe()} is asynchronous"
    for c in collectives:
        if not c.is_input:
            ctx.notes.append(f"async: {c.describe()} is computed from the attention output; "
                             "nothing independent is left to overlap, it stays synchronous")
    for core in sorted(cores, key=order.get):
        feeding = sorted((c for c in collectives if core in c.cores), key=lambda c: order[c.launch])
        for c in feeding:
            if any(is_compute(n) for n in nodes_between(order, nodes, c)):
                continue
            if c is not feeding[-1]:
                raise CPInputError(
                    f"{ctx.fqn}: {method}, but collective {c.describe()} has no compute between its launch "
                    f"and its wait (a launch then a wait is not async); use the synchronous {sync_counterpart(ctx)}"
                )
            ctx.notes.append(f"async: {c.describe()} is the last input of its attention; nothing independent "
                             "is left to overlap, it stays synchronous")
        hidden = {n for c in feeding for n in nodes_between(order, nodes, c) if is_model_compute(n)}
        if feeding and not hidden:
            raise CPInputError(
                f"{ctx.fqn}: {method}, but the attention {core.name} has no model compute to overlap with "
                f"its collectives ({', '.join(c.describe() for c in feeding)}): everything the module "
                "computes either feeds them or consumes them, so each would be a launch then a wait, "
                f"which is not async; use the synchronous {sync_counterpart(ctx)}"
            )


def sync_counterpart(ctx: PassContext) -> str:
    """The wrapper of the same method without the async schedule, as the method registered it."""
    return f"wrapper {method_spec(ctx.method).sync_wrapper}"
