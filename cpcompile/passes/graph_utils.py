"""Small helpers for editing FX graphs while keeping `meta["val"]` valid."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_map


def fake_mode_of(graph: fx.Graph):
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        raise RuntimeError("graph has no fake-tensor metadata; was it produced by torch.export?")
    return mode


class Emitter:
    """Inserts nodes before `anchor`, computing each node's fake value as it goes.

    Every emitted node inherits the anchor's `nn_module_stack` (so the dump shows where it
    belongs) and is stamped with the pass that created it (`meta["cpcompile_pass"]`).
    """

    def __init__(self, graph: fx.Graph, anchor: fx.Node, pass_name: str):
        self.graph = graph
        self.anchor = anchor
        self.pass_name = pass_name
        self.fake_mode = fake_mode_of(graph)

    def __call__(self, op: Callable, *args: Any, **kwargs: Any) -> fx.Node:
        return self._emit(op, op, args, kwargs)

    def core(self, op: Callable, *args: Any, fake: Callable | None = None, **kwargs: Any) -> fx.Node:
        """Emit the call that computes an attention core, tagged so the passes after the rewrite
        find it (`is_core`). `fake(*args, **kwargs)` gives its value where running `op` on fake
        tensors cannot (a call that reads a flag back from the device)."""
        node = self._emit(op, fake or op, args, kwargs)
        node.meta[CORE_TAG] = True
        return node

    def _emit(self, op: Callable, fake: Callable, args: tuple, kwargs: dict) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(op, args, kwargs)
        node.meta["val"] = self._fake_value(fake, args, kwargs)
        if "nn_module_stack" in self.anchor.meta:
            node.meta["nn_module_stack"] = dict(self.anchor.meta["nn_module_stack"])
        node.meta["cpcompile_pass"] = self.pass_name
        return node

    def _fake_value(self, op: Callable, args: tuple, kwargs: dict) -> Any:
        def to_val(a: Any) -> Any:
            return a.meta["val"] if isinstance(a, fx.Node) else a

        with self.fake_mode:
            return op(*tree_map(to_val, args), **tree_map(to_val, kwargs))


CORE_TAG = "cpcompile_core"


def is_core(node: fx.Node) -> bool:
    """A node a rewrite emitted as the local computation of an attention core."""
    return node.meta.get(CORE_TAG, False)


@dataclass
class CoreMatch:
    """An attention core a finder matched: `node` is its call. Every kind of match (SDPA, GDN)
    is replaced the same way, by `replace_with` (as `micro_pipeline_tp`'s matches are)."""

    node: fx.Node

    def replace_with(self, gm: fx.GraphModule, output: fx.Node) -> None:
        """Make every user of the core read `output` instead, and drop the core."""
        self.node.replace_all_uses_with(output)
        gm.graph.erase_node(self.node)


def val(node: fx.Node) -> Any:
    """The fake value recorded for `node` (a FakeTensor for tensor-valued nodes)."""
    return node.meta["val"]


def _reachable(start: list[fx.Node], step) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(start)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(step(n))
    return seen


def ancestors(node: fx.Node) -> set[fx.Node]:
    """All nodes `node` depends on, itself excluded."""
    return _reachable(node.all_input_nodes, lambda n: n.all_input_nodes)


def descendants(node: fx.Node) -> set[fx.Node]:
    """All nodes that depend on `node`, itself excluded."""
    return _reachable(list(node.users), lambda n: n.users)


def evaluate_node(gm: fx.GraphModule, target: fx.Node, flat_inputs: list[Any]) -> Any:
    """Compute the real value of one node from the region's real inputs.

    Only `target`'s ancestors are run, so checking e.g. an attention mask costs a few ops,
    not a forward of the region.
    """
    needed = ancestors(target) | {target}
    env: dict[fx.Node, Any] = {}
    placeholders = iter(flat_inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = next(placeholders)
            if node in needed:
                env[node] = value
            if node is target:
                return value
            continue
        if node not in needed:
            continue
        args = tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.args)
        kwargs = tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.kwargs)
        if node.op == "call_function":
            env[node] = node.target(*args, **kwargs)
        elif node.op == "get_attr":
            env[node] = getattr(gm, node.target)
        else:
            raise RuntimeError(f"cannot evaluate {node.op} node {node.name} outside the region")
        if node is target:
            return env[node]
    raise RuntimeError(f"node {target.name} not found in graph")
