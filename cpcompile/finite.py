"""``CPCOMPILE_CHECK_FINITE=1``: every CP region checks what it computed for NaN and Inf.

A kernel that returns NaN poisons every layer after it, and a training loop sees it only as a
non-finite loss, steps later and layers away. With the guard on, each region checks its output
after its forward and, in the backward, the gradient it hands to its inputs. The cp group agrees
on the finding (one small all-gather per check), so every rank raises the same
``NonFiniteError``, naming the region (the layer), forward or backward, the cp ranks that saw it
and the step: the trainer's (``set_step``), else the region's own count of forward calls. No rank
is left waiting in the next collective. A region whose input was already non-finite says so, so
the first region named is where it started.

Off by default: each check is a reduction, a host sync and that all-gather per region call (cost
in docs/debugging.md). Under ``torch.compile`` the checks are graph breaks.
"""
from __future__ import annotations

import os

import torch
from torch.utils import _pytree as pytree

from .agreement import ALL_GATHER_INTO, _device
from .errors import NonFiniteError

CHECK_FINITE_ENV = "CPCOMPILE_CHECK_FINITE"

_step: int | None = None


def check_finite_enabled() -> bool:
    return os.environ.get(CHECK_FINITE_ENV, "0") == "1"


def set_step(step: int | None) -> None:
    """The step a non-finite error names (the trainer sets it before each step; None: per-region counts)."""
    global _step
    _step = step


def _non_finite(tensors) -> bool:
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors)


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


class FiniteGuard:
    """The checks of one region (``fqn``) on ``mesh``'s cp group (None: this process alone); call
    ``around(leaves, run)`` in place of ``run(leaves)``."""

    def __init__(self, fqn: str, mesh=None):
        self.fqn = fqn
        self.mesh = mesh
        self.forward_calls = 0

    def around(self, leaves: list, run):
        inputs = _tensors(leaves)
        if torch._C._current_graph_task_id() == -1:  # not an activation-checkpoint recompute
            self.forward_calls += 1
        out = run(leaves)
        seen = self._ranks_with(_non_finite(_tensors(out)))
        if seen:
            late = self._ranks_with(_non_finite(inputs))
            cause = (f"its input was already non-finite on cp rank(s) {late}" if late else "its inputs were finite")
            raise NonFiniteError(f"{self.fqn}: the CP region's forward output has NaN or Inf on cp rank(s) {seen} "
                                 f"at {self._where()} ({cause}; {CHECK_FINITE_ENV}=1)")
        for tensor in inputs:
            if tensor.requires_grad:
                tensor.register_hook(self._gradient_check)
        return out

    def _gradient_check(self, grad: torch.Tensor) -> None:
        seen = self._ranks_with(_non_finite([grad]))
        if seen:
            raise NonFiniteError(f"{self.fqn}: the CP region's backward gave its input a NaN or Inf gradient on cp "
                                 f"rank(s) {seen} at {self._where()} ({CHECK_FINITE_ENV}=1)")

    def _where(self) -> str:
        return f"step {_step}" if _step is not None else f"forward call {self.forward_calls} of this region"

    def _ranks_with(self, flag: bool) -> list[int]:
        """The cp ranks whose ``flag`` is set, the same list on every rank."""
        if self.mesh is None or self.mesh.cp_size == 1:
            return [0] if flag else []
        mine = torch.tensor([int(flag)], dtype=torch.int64, device=_device(self.mesh))
        gathered = mine.repeat(self.mesh.cp_size)
        ALL_GATHER_INTO(gathered, mine, group=self.mesh.cp_group)
        return [rank for rank, value in enumerate(gathered.tolist()) if value]
