"""Coverage of the plan, checked on the probe forward before any region is traced: every attention
core lies in exactly one region of its kind (`check_coverage`, with `attention_hint` for a Hugging
Face model built with another attention than SDPA), no module outside the regions mixes sequence
positions (`check_mixers`, from `audit.mixers`' findings), and the example is called as a CP model
always is, with its positions (`refuse_example_without_positions`). docs/audits.md lists them.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from ..errors import CoverageError, CPInputError
from ..methods.local_compute import LOCAL_CORE

if TYPE_CHECKING:
    from ..installed_region import Target


def attention_hint(model: nn.Module) -> str:
    """For a Hugging Face model built with another attention than SDPA (`eager`, flash, flex),
    whose attention then never calls `scaled_dot_product_attention`: how to build it instead."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not isinstance(implementation, str) or implementation == "sdpa":
        return ""
    return (f"; the model was built with attn_implementation={implementation!r}: build it with "
            'attn_implementation="sdpa", whose attention calls scaled_dot_product_attention, the core CP rewrites')


def check_coverage(targets: list[Target], core_sites: list[tuple[str, tuple[str, ...]]],
                   modules: dict[str, nn.Module] | None = None, hint: str = "") -> None:
    """Every core runs inside exactly one region, of the kind its method rewrites; `modules` names an
    uncovered core's class, `hint` is added where an SDPA region ran no SDPA core (`attention_hint`)."""
    by_fqn = {t.fqn: t for t in targets}
    seen: set[str] = set()
    for kind, stack in core_sites:
        covering = [by_fqn[f] for f in stack if f in by_fqn]
        where = stack[-1] if stack else "<model>"
        if not covering:
            module = (modules or {}).get(where)
            named = f"{where!r} ({type(module).__name__})" if module is not None else repr(where)
            raise CoverageError(f"{kind} core in module {named} is not covered by any plan override; CP>1 needs an explicit method for every attention core")
        target = covering[0]
        if target.override.method.core not in (kind, LOCAL_CORE):  # a local_compute_fn takes over any core
            raise CoverageError(f"module {target.fqn!r} runs a {kind} core but its override selects {target.override.method.describe()}")
        seen.add(target.fqn)
    for target in targets:
        if target.fqn not in seen and target.override.method.core != LOCAL_CORE:
            core = target.override.method.core
            raise CoverageError(f"{target.override.field('match')}: module {target.fqn!r} ran no {core} core in the "
                                f"probe forward{hint if core == 'sdpa' else ''}")



def check_mixers(probe) -> None:
    """Refuse the modules outside the regions that mix sequence positions (`audit.mixers`): each
    rank would run them on its own slice alone."""
    if probe.mixers:
        raise CoverageError(
            f"{len(probe.mixers)} module(s) outside the CP regions mix positions of the sequence, so each rank would "
            f"run them on its own slice alone (silently wrong under CP): {probe.mixers_report}. Give each a CP method "
            "in the plan (an override matching it), or use a model without them; position-wise modules (MLP, norms, "
            "rotary) pass this check")


def refuse_example_without_positions(model: nn.Module, example: Any) -> None:
    """A model taking `position_ids` is always called with them under CP (`sequence_layout.LayoutGuard`), and
    without them it numbers each rank's tokens from 0: an example without them would be audited
    (audit/cuts.py) and traced on a call that never happens."""
    if not isinstance(example, dict) or example.get("position_ids") is not None:
        return
    if "position_ids" in inspect.signature(model.forward).parameters:
        raise CPInputError(
            f"example_inputs has no position_ids, which {type(model).__name__} takes: a CP model is always called "
            "with the global positions of its tokens (without them it would number each rank's slice from 0); pass "
            "the local batch cpcompile.shard_batch returns as example_inputs")
