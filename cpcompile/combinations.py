"""Which CP methods may share one plan: checked by `compile` before anything is traced.

One batch has one sequence layout. Head-Tail load balance needs the batch in head-tail order
(rank r holds chunks r and 2·cp−1−r), every other method needs it contiguous, so a plan that
mixes them would feed some module tokens in an order its rewrite does not expect. `shard_batch`
refuses such a plan too; `compile` refuses it first, naming the two overrides.
"""
from __future__ import annotations

from typing import Iterable

from .errors import PlanError
from .methods import HEAD_TAIL
from .plan import Override


def check_method_combination(overrides: Iterable[Override]) -> None:
    """Raise `PlanError` if a Head-Tail override shares the plan with one needing contiguous order."""
    overrides = list(overrides)
    head_tail = next((o for o in overrides if o.method is not None and o.method.layout == HEAD_TAIL), None)
    if head_tail is None:
        return
    that = f"{head_tail.field('inner_wrapper')} (match {head_tail.match!r}: {_method(head_tail)})"
    for other in overrides:
        this = f"this override (match {other.match!r}: {_method(other)})"
        if other.method is not None and other.method.core == "gdn":
            raise PlanError(other.field("inner_wrapper"), (
                f"GDN needs the contiguous sequence order, so {this} cannot share a plan with {that}, "
                "which reorders the batch head-tail (GDN has no Head-Tail support yet)"))
        if other.method is None or other.method.layout != HEAD_TAIL:
            raise PlanError(other.field("inner_wrapper"), (
                f"{this} needs the contiguous sequence order but {that} reorders the batch head-tail, "
                "and one batch has one order; use Head-Tail for every override or for none"))


def _method(override: Override) -> str:
    return override.method.describe() if override.method is not None else f"local_compute_fn {override.local_compute_fn}"
