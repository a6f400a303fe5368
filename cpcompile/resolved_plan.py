"""The plan, resolved once against the model and the mesh: what `compile`'s later stages read.

`resolve_plan` runs every check that needs neither a collective nor a forward, in this order: the
plan's cp size against the mesh's, the active overrides (none: the model is left as it is), the
parallelisms CP cannot run beside, TP applied before CP, one sequence layout, then the regions the
overrides match. Its result, a `ResolvedPlan`, is what the ranks agree on and what the probe, the
traces and the install read; no later stage goes back to the plan.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch.nn as nn

from .agreement import ITEM_SEPARATOR
from .errors import AlreadyCompiledError, CoverageError, CPConfigError, PlanError, UnsupportedError
from .installed_region import MARKER, Target
from .methods import method_spec
from .plan import Override, Plan, sequence_layout
from .tp import check_tp_applied

log = logging.getLogger("cpcompile")


@dataclass(frozen=True)
class ResolvedPlan:
    """The active overrides, the regions they match (`targets`, in the plan's order), the batch's
    one sequence layout, the Ulysses degrees whose sub-groups the methods need (`subgroup_degrees`,
    built on every rank before any trace) and those of the asynchronous methods, whose backward
    gets the forward's schedule under Inductor (`asynchronous`: any such method)."""

    cp_size: int
    tp_size: int
    overrides: tuple[Override, ...] = ()
    targets: tuple[Target, ...] = ()
    layout: str | None = None
    subgroup_degrees: tuple[int, ...] = ()
    asynchronous: bool = False
    async_subgroup_degrees: tuple[int, ...] = ()

    def agreement_fields(self) -> dict[str, str]:
        """What every rank's plan must fix alike: the cp size, the sequence layout, each region's
        method, and the parameter shapes of the regions (the same model)."""
        return {
            "cp_size": str(self.cp_size),
            "layout": str(self.layout),
            "methods": ITEM_SEPARATOR.join(f"{t.fqn}: {t.override.method.describe()}" for t in self.targets),
            "region parameters": ITEM_SEPARATOR.join(
                f"{t.fqn}.{name}: {list(p.shape)}" for t in self.targets for name, p in t.module.named_parameters()
            ),
        }


def resolve_plan(model: nn.Module, mesh, plan: Plan) -> ResolvedPlan:
    """The checks of the module doc, then the `ResolvedPlan`; one without targets when no override
    is active (the model is then left unchanged)."""
    if plan.cp_size != mesh.cp_size:
        raise CPConfigError(f"plan has cp_size={plan.cp_size} but the mesh's cp dimension has size {mesh.cp_size}")
    tp_size = plan.accelerator.tp_size
    overrides = plan.active_overrides()
    if not overrides:
        refuse_empty_plan(plan)
        log.info("cpcompile: no active plan overrides (cp_size=%d); model left unchanged", plan.cp_size)
        return ResolvedPlan(plan.cp_size, tp_size)
    reject_unsupported_combinations(plan, overrides)
    check_tp_applied(model, tp_size)
    layout = sequence_layout(overrides)  # one batch has one sequence layout: refuse overrides that need different ones
    targets = resolve_targets(model, overrides)
    asynchronous = [o for o in overrides if o.method.asynchronous]
    return ResolvedPlan(plan.cp_size, tp_size, tuple(overrides), tuple(targets), layout,
                        subgroup_degrees=needed_subgroups(overrides), asynchronous=bool(asynchronous),
                        async_subgroup_degrees=needed_subgroups(asynchronous))


def refuse_empty_plan(plan: Plan) -> None:
    """A plan with no override at CP>1 would leave every attention unrewritten: a rank fed its
    slice would attend only within it, silently wrong. At cp_size 1 the `when: cp` overrides are
    inactive on purpose (the model is left as it is)."""
    if plan.cp_size > 1:
        raise CoverageError(
            f"cp_size={plan.cp_size} but the plan has no plan_overrides (an empty list, or a blank "
            "`plan_overrides:` line): CP>1 needs an explicit method for every attention core; unrewritten, "
            "each rank would attend only within its own slice of the sequence"
        )


def reject_unsupported_combinations(plan: Plan, overrides) -> None:
    for name, size in plan.accelerator.not_with_cp():
        raise UnsupportedError(f"accelerator.{name}={size} together with context parallelism is not supported yet")
    tp_size = plan.accelerator.tp_size
    for override in overrides:
        if tp_size > 1 and override.method is not None and override.method.core == "gdn":
            raise UnsupportedError(
                f"{override.field('inner_wrapper')}: accelerator.tp_size={tp_size} with a Gated DeltaNet CP method "
                f"({override.method.describe()}): TP+CP on GDN layers is out of scope (the GDN RFC refuses it: its CP "
                "methods split or chain the recurrent state of the whole layer's heads); set tp_size: 1"
            )


def needed_subgroups(overrides) -> tuple[int, ...]:
    """The Ulysses degrees whose (Ulysses, ring) sub-groups the overrides' methods use, sorted."""
    return tuple(sorted({degree for o in overrides for degree in method_spec(o.method).subgroups(o.method.params)}))


def resolve_targets(model: nn.Module, overrides) -> list[Target]:
    modules = dict(model.named_modules())
    targets: dict[str, Target] = {}
    for override in overrides:
        hits = [fqn for fqn in modules if fqn and fnmatchcase(fqn, override.match)]
        if not hits:
            raise PlanError(override.field("match"), f"{override.match!r} matches no module of {type(model).__name__}")
        for fqn in hits:
            region_fqn = fqn if override.inner_target == "self" else f"{fqn}.{override.inner_target}"
            if region_fqn not in modules:
                raise PlanError(override.field("inner_target"), f"module {fqn!r} has no submodule {override.inner_target!r}")
            if region_fqn in targets:
                other = targets[region_fqn].override
                raise PlanError(override.field("match"), f"module {region_fqn!r} is also matched by {other.field('match')} ({other.match!r})")
            module = modules[region_fqn]
            if hasattr(module, MARKER):
                raise AlreadyCompiledError(f"module {region_fqn!r} was already compiled by cpcompile ({getattr(module, MARKER)})")
            targets[region_fqn] = Target(region_fqn, module, override)
    for fqn in targets:
        for other in targets:
            if other != fqn and other.startswith(fqn + "."):
                raise PlanError(targets[other].override.field("match"), f"region {other!r} lies inside region {fqn!r}; regions must not nest")
    return list(targets.values())
