"""Stage 1 of the pipeline: parse and validate a CP plan (`accelerator:` + `plan_overrides:`).

A plan comes from a YAML file (read with `yaml.safe_load` only), a dict of the same shape, or a
`Plan` built in Python. Every error is a `PlanError` naming the field path and the reason.

What a plan may *not* do, on purpose:
- choose a CP algorithm globally (`accelerator.cp.*`, `algorithm`, `schedule`, `ulysses_degree`,
  `load_balance`, `async_fallback` are rejected): the method is declared per module, by the
  `inner_wrapper` of a `plan_overrides` entry, and nothing is picked by default;
- call an arbitrary callable: `_target_` must resolve to a function carrying the
  `@cpcompile.inner_wrapper` marker (checked before anything is called);
- import a module because it named it: a `_target_` must be the path of a registered name or lie
  in an allowed module (cpcompile's own, or one allowed with `cpcompile.allow_wrapper_module`);
- grow without bound: a YAML file above `MAX_YAML_BYTES`, or whose aliases expand it beyond
  `MAX_YAML_NODES` nodes, is refused, and the values an error shows are cut short (`short_repr`).

`local_compute_fn` names a function registered with `@cpcompile.local_compute_fn` (never together
with `inner_wrapper`); it resolves to a `CPMethod` of the `local` core (methods/local_compute.py).
`region_dispatch` must be false, except for a local compute function declared without collectives.

The YAML is read, and keys and sizes checked, by `yaml_input.py` (`read_yaml`,
`reject_unknown_keys`, `check_size`), which the trainer's config (`trainer/config.py`) uses the
same way, with `AcceleratorConfig.not_with_cp` for the parallelisms CP cannot be combined with.
An `inner_wrapper` is resolved to its `CPMethod` by `methods/resolve.py`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .errors import PlanError, short_repr
from .methods import CONTIGUOUS, CPMethod, methods_of_core
from .methods.local_compute import LOCAL_CORE, local_compute_method, registered_local_compute
from .methods.resolve import resolve_inner_wrapper
from .yaml_input import check_size, read_yaml, reject_unknown_keys

logger = logging.getLogger("cpcompile")

TOP_LEVEL_KEYS = ("accelerator", "plan_overrides")
SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "ep_size", "pp_size")
NOT_WITH_CP = ("pp_size", "ep_size")  # parallelisms cpcompile cannot combine with CP yet
FLAG_KEYS = ("sequence_parallel", "loss_parallel")
LEGACY_CP_KEYS = ("algorithm", "schedule", "ulysses_degree", "load_balance", "async_fallback")
OVERRIDE_KEYS = ("match", "when", "region_dispatch", "inner_target", "inner_wrapper", "local_compute_fn")
SUPPORTED_WHEN = ("cp",)

_LEGACY_HINT = (
    "global CP method settings are no longer supported; declare the method per module with "
    "plan_overrides[].inner_wrapper (a registered name such as 'sdpa_hf', or "
    "{_target_: <marked wrapper>, <its own parameters, e.g. ulysses_degree>})"
)
BOTH_SET = "exactly one of inner_wrapper / local_compute_fn is required (both are set)"
NEITHER_SET = "exactly one of inner_wrapper / local_compute_fn is required (neither is set)"
_REGION_DISPATCH_HINT = (
    "must be exactly false for a CP override: CP wrappers own their communication, so the "
    "region must not be dispatched again"
)

# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class AcceleratorConfig:
    """Topology sizes. EP is derived from the dense ranks, so it is not part of `world_size`."""

    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_replicate_size * self.dp_shard_size * self.cp_size * self.tp_size

    def world_size_formula(self) -> str:
        return (
            f"pp({self.pp_size}) x dp_replicate({self.dp_replicate_size}) x "
            f"dp_shard({self.dp_shard_size}) x cp({self.cp_size}) x tp({self.tp_size}) = {self.world_size}"
        )

    def not_with_cp(self) -> list[tuple[str, int]]:
        """(field, size) of every parallelism set beside CP that cannot run with it: PP and EP
        (`compile` and `cpcompile train` refuse them)."""
        return [(key, getattr(self, key)) for key in NOT_WITH_CP if getattr(self, key) > 1]

    def validate(self) -> "AcceleratorConfig":
        for key in SIZE_KEYS:
            check_size(f"accelerator.{key}", getattr(self, key))
        for key in FLAG_KEYS:
            _check_flag(f"accelerator.{key}", getattr(self, key))
        return self


@dataclass(frozen=True)
class Override:
    """One validated `plan_overrides` entry. `index` is its position, used in error paths."""

    match: str
    when: str
    region_dispatch: bool
    inner_target: str = "self"
    method: CPMethod | None = None
    local_compute_fn: str | None = None
    index: int = 0

    def field(self, name: str) -> str:
        return f"plan_overrides[{self.index}].{name}"

    def validate(self) -> "Override":
        _check_match(self.field("match"), self.match)
        _check_when(self.field("when"), self.when)
        _check_inner_target(self.field("inner_target"), self.inner_target)
        if self.local_compute_fn is not None:
            if self.method is None:  # built in Python with the function's path only: resolve it once
                method = _resolve_local_compute(self.field("local_compute_fn"), self.local_compute_fn, self.region_dispatch)
                object.__setattr__(self, "method", method)  # frozen: the resolved method is part of the override
            elif self.method.core != LOCAL_CORE:
                raise PlanError(self.field("inner_wrapper"), BOTH_SET)
            return self
        _check_region_dispatch(self.field("region_dispatch"), self.region_dispatch)
        if self.method is None:
            raise PlanError(self.field("inner_wrapper"), NEITHER_SET)
        if not isinstance(self.method, CPMethod):
            raise PlanError(
                self.field("inner_wrapper"),
                f"method must be a cpcompile.methods.CPMethod, got {type(self.method).__name__}",
            )
        return self


@dataclass(frozen=True)
class Plan:
    """A validated plan. Building one in Python re-indexes the overrides; call `validate()`."""

    accelerator: AcceleratorConfig = AcceleratorConfig()
    overrides: tuple[Override, ...] = ()

    def __post_init__(self):
        overrides = tuple(self.overrides)
        # `index` follows the position so error paths stay right for hand-built plans.
        overrides = tuple(
            dataclasses.replace(o, index=i) if isinstance(o, Override) and o.index != i else o
            for i, o in enumerate(overrides)
        )
        object.__setattr__(self, "overrides", overrides)

    @property
    def cp_size(self) -> int:
        return self.accelerator.cp_size

    def validate(self) -> "Plan":
        if not isinstance(self.accelerator, AcceleratorConfig):
            raise PlanError(
                "accelerator", f"must be an AcceleratorConfig, got {type(self.accelerator).__name__}"
            )
        self.accelerator.validate()
        for i, override in enumerate(self.overrides):
            if not isinstance(override, Override):
                raise PlanError(f"plan_overrides[{i}]", f"must be an Override, got {type(override).__name__}")
            override.validate()
        _check_unique_matches(self.overrides)
        return self

    def active_overrides(self) -> tuple[Override, ...]:
        """The overrides that apply now: `when: cp` entries only when cp_size > 1."""
        if self.cp_size > 1:
            return tuple(o for o in self.overrides if o.when == "cp")
        skipped = [o.match for o in self.overrides if o.when == "cp"]
        if skipped:
            logger.info(
                "cp_size=1: skipping %d plan_overrides with 'when: cp' (%s); the model is left untouched",
                len(skipped), ", ".join(skipped),
            )
        return tuple(o for o in self.overrides if o.when != "cp")

    def layout(self) -> str | None:
        """The one sequence layout of the batch (`shard_batch`) that the active overrides fix;
        None when none is active. A `PlanError` when they need different ones (`sequence_layout`)."""
        return sequence_layout(self.active_overrides())

    def cuts_documents(self) -> bool:
        """Whether `shard_batch` may cut a packed Head-Tail batch per document (every rank a head
        and a tail piece of every document); not when an active override needs the layout's two
        fixed chunks (`CPMethod.fixed_chunks`: GDN in Head-Tail order)."""
        return not any(o.method is not None and o.method.fixed_chunks for o in self.active_overrides())


# --------------------------------------------------------------------------- the one-layout rule


def sequence_layout(overrides: Iterable[Override]) -> str | None:
    """The sequence layout every override needs; None without overrides.

    One batch has one sequence layout. Head-Tail load balance (SDPA, and GDN in Head-Tail order)
    needs the batch in head-tail order (rank r holds chunks r and 2·cp−1−r); every other method,
    and a `local_compute_fn`, needs it contiguous. A plan that mixes them would feed some module
    tokens in an order its rewrite does not expect, so it is refused, naming two overrides that
    disagree: by `compile` before anything is traced, and by `shard_batch`, which asks the same rule.
    """
    overrides = list(overrides)
    if not overrides:
        return None
    first = overrides[0]
    for other in overrides[1:]:
        if _needed_layout(other) != _needed_layout(first):
            raise _layout_conflict(first, other)
    return _needed_layout(first)


def _needed_layout(override: Override) -> str:
    return override.method.layout if override.method is not None else CONTIGUOUS


def _layout_conflict(a: Override, b: Override) -> PlanError:
    reordered, plain = (a, b) if _needed_layout(a) != CONTIGUOUS else (b, a)
    that = f"{reordered.field('inner_wrapper')} (match {short_repr(reordered.match)}: {_describe(reordered)})"
    this = f"this override (match {short_repr(plain.match)}: {_describe(plain)})"
    core = plain.method.core if plain.method is not None else None
    if core is not None and not any(spec.layout == _needed_layout(reordered) for spec in methods_of_core(core)):
        kind = core.upper()  # a core kind with no method for the other layout, e.g. GDN
        reason = (f"{kind} needs the contiguous sequence order, so {this} cannot share a plan with {that}, "
                  f"which reorders the batch head-tail ({kind} has no Head-Tail support yet)")
    else:
        reason = (f"{this} needs the contiguous sequence order but {that} reorders the batch head-tail, "
                  "and one batch has one order; use Head-Tail for every override or for none")
    return PlanError(plain.field("inner_wrapper"), reason)


def _describe(override: Override) -> str:
    method = override.method
    return method.describe() if method is not None else f"local_compute_fn {override.local_compute_fn}"


# --------------------------------------------------------------------------- entry point


def load_plan(source: "str | os.PathLike | Mapping[str, Any] | Plan") -> Plan:
    """Read and validate a plan from a YAML path, a dict of the same shape, or a `Plan`."""
    if isinstance(source, Plan):
        return source.validate()
    if isinstance(source, (str, os.PathLike)):
        return _parse_top_level(read_yaml(source))
    if isinstance(source, Mapping):
        return _parse_top_level(source)
    raise TypeError(
        f"load_plan expects a YAML path, a dict or a Plan, got {type(source).__name__}"
    )


# --------------------------------------------------------------------------- parsing


def _parse_top_level(raw: Any) -> Plan:
    if raw is None:
        raise PlanError("<plan>", "the plan is empty; expected a mapping with accelerator and plan_overrides")
    if not isinstance(raw, Mapping):
        raise PlanError("<plan>", f"must be a mapping, got {type(raw).__name__}")
    reject_unknown_keys("", raw, TOP_LEVEL_KEYS)
    accelerator = _parse_accelerator(raw.get("accelerator", {}))
    raw_overrides = raw.get("plan_overrides", [])
    if raw_overrides is None:
        raw_overrides = []
    if not isinstance(raw_overrides, (list, tuple)):
        raise PlanError("plan_overrides", f"must be a list, got {type(raw_overrides).__name__}")
    overrides = tuple(_parse_override(i, entry) for i, entry in enumerate(raw_overrides))
    return Plan(accelerator=accelerator, overrides=overrides).validate()


def _parse_accelerator(raw: Any) -> AcceleratorConfig:
    if not isinstance(raw, Mapping):
        raise PlanError("accelerator", f"must be a mapping, got {type(raw).__name__}")
    _reject_legacy_keys(raw)
    reject_unknown_keys("accelerator", raw, SIZE_KEYS + FLAG_KEYS)
    return AcceleratorConfig(**dict(raw)).validate()


def _reject_legacy_keys(raw: Mapping) -> None:
    for key in LEGACY_CP_KEYS:
        if key in raw:
            raise PlanError(f"accelerator.{key}", _LEGACY_HINT)
    if "cp" in raw:
        cp = raw["cp"]
        if isinstance(cp, Mapping):
            for key in LEGACY_CP_KEYS:
                if key in cp:
                    raise PlanError(f"accelerator.cp.{key}", _LEGACY_HINT)
        raise PlanError("accelerator.cp", f"{_LEGACY_HINT}; the CP degree is accelerator.cp_size")


def _parse_override(index: int, raw: Any) -> Override:
    path = f"plan_overrides[{index}]"
    if not isinstance(raw, Mapping):
        raise PlanError(path, f"must be a mapping, got {type(raw).__name__}")
    reject_unknown_keys(path, raw, OVERRIDE_KEYS)
    for key in ("match", "when"):
        if key not in raw:
            raise PlanError(f"{path}.{key}", "is required")
    _check_match(f"{path}.match", raw["match"])
    _check_when(f"{path}.when", raw["when"])
    if "region_dispatch" not in raw:
        raise PlanError(f"{path}.region_dispatch", f"is required; it {_REGION_DISPATCH_HINT}")
    inner_target = raw.get("inner_target", "self")
    _check_inner_target(f"{path}.inner_target", inner_target)

    has_wrapper, has_fn = "inner_wrapper" in raw, "local_compute_fn" in raw
    if has_wrapper == has_fn:
        raise PlanError(f"{path}.inner_wrapper", BOTH_SET if has_wrapper else NEITHER_SET)
    if has_fn:
        spec = raw["local_compute_fn"]
        method = _resolve_local_compute(f"{path}.local_compute_fn", spec, raw["region_dispatch"])
        return Override(match=raw["match"], when=raw["when"], region_dispatch=raw["region_dispatch"],
                        inner_target=inner_target, method=method, local_compute_fn=method.wrapper, index=index)
    _check_region_dispatch(f"{path}.region_dispatch", raw["region_dispatch"])
    method = resolve_inner_wrapper(f"{path}.inner_wrapper", raw["inner_wrapper"])
    return Override(
        match=raw["match"], when=raw["when"], region_dispatch=False,
        inner_target=inner_target, method=method, local_compute_fn=None, index=index,
    )


def _resolve_local_compute(path: str, spec: Any, region_dispatch: Any) -> CPMethod:
    """The `CPMethod` of a registered local compute function; its region_dispatch rule."""
    try:
        found, params = registered_local_compute(spec)
    except ValueError as exc:
        raise PlanError(path, str(exc)) from exc
    if region_dispatch is True and found.collectives:
        raise PlanError(
            path.rpartition(".")[0] + ".region_dispatch",
            f"is true, but local_compute_fn {found.path} has collectives (the default of @cpcompile.local_compute_fn); "
            "a local compute with collectives requires region_dispatch: false, so the region is not dispatched again; "
            "declare @cpcompile.local_compute_fn(collectives=False) only for a function that communicates with no rank",
        )
    if region_dispatch is not True:
        _check_region_dispatch(path.rpartition(".")[0] + ".region_dispatch", region_dispatch)
    return local_compute_method(found, params)


# --------------------------------------------------------------------------- field checks


def _check_flag(path: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PlanError(path, f"must be true or false, got {short_repr(value)} ({type(value).__name__})")


def _check_match(path: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise PlanError(path, f"must be a non-empty string (an fnmatch glob over module FQNs), got {short_repr(value)}")


def _check_when(path: str, value: Any) -> None:
    if not isinstance(value, str) or value not in SUPPORTED_WHEN:
        raise PlanError(path, f"unsupported value {short_repr(value)}; accepted: {', '.join(SUPPORTED_WHEN)}")


def _check_region_dispatch(path: str, value: Any) -> None:
    if value is not False:
        raise PlanError(path, f"got {short_repr(value)}; it {_REGION_DISPATCH_HINT}")


def _check_inner_target(path: str, value: Any) -> None:
    if not isinstance(value, str):
        raise PlanError(path, f"must be 'self' or a dotted submodule path, got {type(value).__name__}")
    if value == "self":
        return
    parts = value.split(".")
    if not all(p and (p.isidentifier() or p.isdigit()) for p in parts):
        raise PlanError(path, "must be 'self' or a dotted submodule path like 'core_attention', "
                              f"got {short_repr(value)}")


def _check_unique_matches(overrides: tuple[Override, ...]) -> None:
    seen: dict[str, int] = {}
    for o in overrides:
        if o.match in seen:
            raise PlanError(
                o.field("match"),
                f"{short_repr(o.match)} is also the match of plan_overrides[{seen[o.match]}]; "
                "each module may have only one override (ambiguous)",
            )
        seen[o.match] = o.index
