"""How the cut audit (`audit/cuts.py`) cuts the example and compares a cut run's values with the
whole window's run: a value of the cut run must be the window's value cut along the axes where
the two differ in length (an axis of the window's length, or of batch × it for flattened tokens);
a plain value (an int, a flag) must be equal."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .tokens import TokenBatch

# A float value "differs" past this fraction of its largest entry: rounding of the same per-token
# work at another length stays ~1e-7 (fp32), an ulp or two (bf16); a wrong position or token moves
# a value by O(1) of its scale.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
HALF_TOLERANCE = 2e-2


@dataclass(frozen=True)
class Cut:
    """Tokens `start` to `stop - 1` of the audit's window of `length` tokens."""

    start: int
    stop: int
    length: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def describe(self) -> str:
        return f"tokens {self.start}..{self.stop - 1} of a {self.length}-token window of the example"


def kept_leaves(tree: Any) -> list[tuple[str, Any]]:
    """`tree`'s leaves with their paths; tensors detached and copied (later code may change them in place)."""
    leaves = pytree.tree_flatten_with_path(tree)[0]
    return [(pytree.keystr(path), leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf)
            for path, leaf in leaves]


def readable(path: str) -> str:
    """`[1]['position_embeddings'][0]` -> `position_embeddings[0]`; `[0][2]` -> `arg2`."""
    if path.startswith("[1]['"):
        name, _, rest = path[len("[1]['"):].partition("']")
        return name + rest
    if path.startswith("[0]["):
        index, _, rest = path[len("[0]["):].partition("]")
        return f"arg{index}" + rest
    return path


def cut_example(example: Any, tokens: TokenBatch, cut: Cut) -> Any:
    """The example with every sequence axis (`TokenBatch.sequence_axes`) narrowed to `cut`."""
    def narrow(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        for axis in tokens.sequence_axes(leaf):
            leaf = leaf.narrow(axis, cut.start, cut.size)
        return leaf.contiguous()  # as a batch of that length would be (model code may `view` it)
    return pytree.tree_map(narrow, example)


def aligned(whole: torch.Tensor, shape: torch.Size, cut: Cut, batch: int) -> torch.Tensor | None:
    """`whole` (a value of the whole window's run) cut along the axes where `shape` (the same value
    in the cut run) is shorter: an axis of the window's length, or of batch × it (flattened
    tokens); None when the shapes do not differ that way."""
    if whole.dim() != len(shape):
        return None
    for axis, (mine, theirs) in enumerate(zip(whole.shape, shape)):
        if mine == theirs:
            continue
        if mine == cut.length and theirs == cut.size:
            whole = whole.narrow(axis, cut.start, cut.size)
        elif mine == batch * cut.length and theirs == batch * cut.size:
            rows = whole.unflatten(axis, (batch, cut.length)).narrow(axis + 1, cut.start, cut.size)
            whole = rows.flatten(axis, axis + 1)
        else:
            return None
    return whole


def same_cut(whole: Any, part: Any, cut: Cut, batch: int) -> bool:
    """Whether `part` (a cut run's value) is `whole` (the window run's) cut the same way; a plain
    value (an int, a flag) must be equal."""
    if not isinstance(whole, torch.Tensor) or not isinstance(part, torch.Tensor):
        return not isinstance(whole, torch.Tensor) and not isinstance(part, torch.Tensor) and \
            type(whole) is type(part) and whole == part
    expected = aligned(whole, part.shape, cut, batch)
    if expected is None or expected.dtype != part.dtype:
        return False
    if not part.is_floating_point():
        return torch.equal(expected, part)
    tolerance = TOLERANCE.get(part.dtype, HALF_TOLERANCE)
    scale = max(expected.abs().nan_to_num(0).max().item() if expected.numel() else 0.0, 1e-30)
    return bool(((expected.float() - part.float()).abs().nan_to_num(0) <= tolerance * scale).all())


def leaves_match(whole: list[tuple[Any, Any]], part: list[tuple[Any, Any]], cut: Cut, batch: int) -> bool:
    return len(whole) == len(part) and all(same_cut(a, b, cut, batch) for (_, a), (_, b) in zip(whole, part))


def tensors_match(whole: list[Any], part: list[Any], cut: Cut, batch: int) -> bool:
    whole = [leaf for leaf in whole if isinstance(leaf, torch.Tensor)]
    part = [leaf for leaf in part if isinstance(leaf, torch.Tensor)]
    return len(whole) == len(part) and all(same_cut(a, b, cut, batch) for a, b in zip(whole, part))
