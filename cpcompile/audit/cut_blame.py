"""What the cut audit (`audit/cuts.py`) records of a run, and how it blames a difference: the module
calls of a run (who called whom, their inputs and outputs), the ops of one call's own code, and
the innermost call whose inputs were still the same cut while what it made was not."""
from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from .cut_values import Cut, kept_leaves, leaves_match, same_cut, tensors_match

OPS_NAMED = 3  # ops of the culprit's own code named in the refusal
PACKAGE_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["cpcompile"]))


@dataclass
class Call:
    """One module call of a run: which (`fqn`, its `index`-th call), who called it (`parent`, a
    position in the run's calls), its inputs and outputs as flat leaves (with their paths)."""

    fqn: str
    index: int
    parent: int | None
    handled: bool
    inputs: list[tuple[str, Any]]
    outputs: list[Any] = field(default_factory=list)


@dataclass
class Op:
    """One torch function the watched call's own code ran: its name, source line, inputs, outputs."""

    name: str
    source: str
    inputs: list[Any]
    outputs: list[Any]


@dataclass
class Run:
    calls: list[Call] = field(default_factory=list)
    outputs: list[tuple[str, Any]] = field(default_factory=list)  # the model's, with their paths
    ops: list[Op] = field(default_factory=list)
    by_call: dict[tuple[str, int], Call] = field(default_factory=dict)  # (fqn, index) -> its call

    def add(self, call: Call) -> int:
        """Record `call`; -> its position in `calls`."""
        self.calls.append(call)
        self.by_call[(call.fqn, call.index)] = call
        return len(self.calls) - 1

    def find(self, fqn: str, index: int) -> Call | None:
        return self.by_call.get((fqn, index))


def innermost_matching_caller(reference: Run, part: Run, position: int | None, cut: Cut, batch: int) -> int:
    """From the caller at `position` up: the first call whose inputs match the whole run's (the
    model's own call always does: its inputs are the example's cut)."""
    while position is not None:
        call = part.calls[position]
        whole = reference.find(call.fqn, call.index)
        if whole is not None and leaves_match(whole.inputs, call.inputs, cut, batch):
            return position
        if call.parent is None:
            return position
        position = call.parent
    return 0


def origin_of_outputs(reference: Run, part: Run, cut: Cut, batch: int) -> int:
    """The innermost call whose inputs match and whose outputs along the sequence do not."""
    origins = []
    for position, call in enumerate(part.calls):
        whole = reference.find(call.fqn, call.index)
        if call.handled or whole is None or not leaves_match(whole.inputs, call.inputs, cut, batch):
            continue
        pairs = [(a, b) for a, b in zip(whole.outputs, call.outputs)
                 if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape]
        if any(not same_cut(a, b, cut, batch) for a, b in pairs):
            origins.append(position)
    inner = [p for p in origins if not any(ancestor_of(part, p, other) for other in origins if other != p)]
    return inner[0] if inner else 0


def ancestor_of(run: Run, ancestor: int, position: int) -> bool:
    parent = run.calls[position].parent
    while parent is not None:
        if parent == ancestor:
            return True
        parent = run.calls[parent].parent
    return False


def differing_ops(reference: Run, part: Run, cut: Cut, batch: int) -> list[str]:
    """The first ops of the watched code whose inputs match the whole run's and whose results do not."""
    named = []
    for whole, ours in zip(reference.ops, part.ops):
        if whole.name != ours.name:
            break  # the two runs took different paths from here
        # a size read is no finding by itself (a cut is shorter): the tensors made from it are
        if tensors_match(whole.inputs, ours.inputs, cut, batch) and \
                not tensors_match(whole.outputs, ours.outputs, cut, batch):
            named.append(f"{ours.name} at {ours.source}")
            if len(named) == OPS_NAMED:
                break
    return named


def describe_call(call: Call) -> str:
    if call.fqn == "":
        return "the model's own forward"
    return f"module {call.fqn}" + (f" (call {call.index})" if call.index else "")


class OpRecorder(TorchFunctionMode):
    """Records the torch functions run by the watched call's own code (not by modules it calls)."""

    def __init__(self, run: Run, stack: list[int], watch: tuple[str, int] | None):
        super().__init__()
        self.run, self.stack, self.watch = run, stack, watch

    def watching(self) -> bool:
        if self.watch is None or not self.stack:
            return False
        call = self.run.calls[self.stack[-1]]
        return (call.fqn, call.index) == self.watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.watching():
            return func(*args, **kwargs)
        inputs = [leaf for _, leaf in kept_leaves((args, kwargs))]
        output = func(*args, **kwargs)
        name = resolve_name(func) or getattr(func, "__name__", repr(func))
        self.run.ops.append(Op(name, caller_line(), inputs, [leaf for _, leaf in kept_leaves(output)]))
        return output


def caller_line() -> str:
    """`file:line: code` of the innermost frame outside torch and cpcompile: the model's code."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIRS):
        frame = frame.f_back
    if frame is None:
        return "<unknown source>"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" + (f": {code}" if code else "")
