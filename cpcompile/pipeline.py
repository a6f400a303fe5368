"""The pipeline behind `cpcompile.compile`: match → probe → trace → rewrite → install, atomically."""
from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn as nn

from .agreement import ITEM_SEPARATOR, agree, plan_fields
from .batch import LayoutGuard
from .capture import probe_forward, trace_region
from .context import DeclaredAttention, PassContext
from .dump import Dump, resolve_dump_dir
from .errors import AlreadyCompiledError, CoverageError, CPConfigError, CPInputError, PlanError, UnsupportedError
from .methods import method_spec, region_for
from .passes import run_passes
from .passes.backward_schedule import enable_for_groups
from .plan import Override, load_plan
from .region import RegionProgram, RetracePolicy, describe_call, flatten_call, shared_signature

log = logging.getLogger("cpcompile")

MARKER = "_cpcompile_config"
PROBE_LENGTH = 16


@dataclass
class Target:
    """One region to rewrite: the module whose forward is replaced, and why."""

    fqn: str
    module: nn.Module
    override: Override


def compile(model: nn.Module, mesh, plan, *, dump_dir=None, example_inputs: Any = None,
            trace_cache_size: int | None = None) -> nn.Module:
    """Rewrite every attention region the plan names into its CP form, in place.

    `example_inputs` is one *local* batch as this rank will feed the model (a dict of
    keyword arguments, or a tuple of positional ones); for a Hugging Face model it may be
    omitted and a small batch of token ids is used (pass the real shapes to avoid tracing
    twice). Every check runs before any module is changed: on error the model's modules are
    left as they were (sub-groups a method needs may already have been created; the probe
    forward runs without gradients on a forked random stream).

    `trace_cache_size`: rewritten graphs each region keeps, one per input signature, least
    recently used dropped first (default `CPCOMPILE_TRACE_CACHE_SIZE`, else 8); docs/batch.md
    says how to keep the number of sequence lengths small.
    """
    plan = load_plan(plan)
    retrace = RetracePolicy.resolve(trace_cache_size)
    if plan.cp_size != mesh.cp_size:
        raise CPConfigError(f"plan has cp_size={plan.cp_size} but the mesh's cp dimension has size {mesh.cp_size}")
    overrides = plan.active_overrides()
    if not overrides:
        log.info("cpcompile: no active plan overrides (cp_size=%d); model left unchanged", plan.cp_size)
        return model
    reject_unsupported_combinations(plan)
    plan.layout()  # one batch has one sequence layout: refuse overrides that need different ones
    targets = resolve_targets(model, overrides)
    agree(mesh, "the plan", plan_fields(plan, targets), CPConfigError)  # before the first collective
    build_subgroups(mesh, overrides)
    example = example_inputs if example_inputs is not None else default_example(model)
    probe = probe_forward(model, example, {t.fqn: t.module for t in targets})
    check_coverage(targets, probe.core_sites)
    dump = Dump(root) if (root := resolve_dump_dir(dump_dir)) else None
    installs = []
    for target in targets:
        args, kwargs = probe.inputs[target.fqn]
        installs.append(InstalledRegion(target, mesh, dump, retrace, args, kwargs))
    for installed in installs:  # nothing above touched the model; from here on nothing can fail
        installed.install()
    schedule_async_backward(mesh, overrides)
    install_layout_guard(model, LayoutGuard(mesh.cp_size, mesh.cp_rank, plan.layout()))
    return model


def install_layout_guard(model: nn.Module, guard: LayoutGuard) -> None:
    """Check every call's `position_ids` against this rank's slice of the plan's layout
    (`batch.LayoutGuard`), for a model that takes them: a token-batch model, such as a Hugging
    Face causal LM (a module taking, say, q, k and v has no batch layout to check)."""
    parameters = list(inspect.signature(model.forward).parameters)
    if "position_ids" not in parameters:
        return
    index = parameters.index("position_ids")

    @torch.compiler.disable  # a Python check of the call, not part of the model's graph
    def check(_module, args, kwargs):
        guard.check(kwargs["position_ids"] if "position_ids" in kwargs else (args[index] if len(args) > index else None))

    model.register_forward_pre_hook(check, with_kwargs=True)


def schedule_async_backward(mesh, overrides: list[Override]) -> None:
    """Under `torch.compile` (Inductor), the backward graphs talking on an async region's groups
    get the forward's schedule too (`passes/backward_schedule.py`); eager backward is unchanged."""
    groups = set()
    for override in overrides:
        if override.method.asynchronous:
            groups.add(mesh.cp_group_name)
            for degree in method_spec(override.method).subgroups(override.method.params):
                groups.update(g.group_name for g in mesh.cp_subgroups(degree))
    if groups:
        enable_for_groups(groups)


def reject_unsupported_combinations(plan) -> None:
    for name, size in plan.accelerator.not_with_cp():
        raise UnsupportedError(f"accelerator.{name}={size} together with context parallelism is not supported yet")


def build_subgroups(mesh, overrides: list[Override]) -> None:
    """Create every sub-group a method needs now, on all ranks in one order.

    `new_group` is collective; a region re-traced later (a new input shape) may do so on one
    rank only, so passes must find their groups already built and cached in the mesh.
    """
    degrees = sorted({degree for o in overrides for degree in method_spec(o.method).subgroups(o.method.params)})
    for degree in degrees:
        mesh.cp_subgroups(degree)


def resolve_targets(model: nn.Module, overrides: list[Override]) -> list[Target]:
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


def check_coverage(targets: list[Target], core_sites: list[tuple[str, tuple[str, ...]]]) -> None:
    """Every core runs inside exactly one region, of the kind its method rewrites."""
    by_fqn = {t.fqn: t for t in targets}
    seen: set[str] = set()
    for kind, stack in core_sites:
        covering = [by_fqn[f] for f in stack if f in by_fqn]
        where = stack[-1] if stack else "<model>"
        if not covering:
            raise CoverageError(f"{kind} core in module {where!r} is not covered by any plan override; CP>1 needs an explicit method for every attention core")
        target = covering[0]
        if target.override.method.core != kind:
            raise CoverageError(f"module {target.fqn!r} runs a {kind} core but its override selects {target.override.method.describe()}")
        seen.add(target.fqn)
    for target in targets:
        if target.fqn not in seen:
            raise CoverageError(f"{target.override.field('match')}: module {target.fqn!r} ran no {target.override.method.core} core in the probe forward")


def default_example(model: nn.Module) -> dict:
    get_embeddings = getattr(model, "get_input_embeddings", None)
    if get_embeddings is None:
        raise CPInputError("pass example_inputs=: cpcompile can only make an example batch for Hugging Face models")
    embeddings = get_embeddings()
    ids = torch.randint(0, embeddings.num_embeddings, (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(0))
    ids = ids.to(embeddings.weight.device)
    return {"input_ids": ids, "use_cache": False}


def declared_attention(region, target: Target) -> DeclaredAttention:
    """What the region's modules declare about their attention, for adapters that read it (SDPA)."""
    read = getattr(region, "declared_attention", None)
    return read(target.fqn, target.module) if read is not None else DeclaredAttention()


class InstalledRegion:
    """The replacement `forward`: one rewritten graph per input signature.

    A call whose input signature (structure, shapes, dtypes, non-tensor values, autocast state)
    was not seen before is traced and rewritten then, before it runs; errors surface the same
    way. The graphs are kept least recently used first, at most `retrace.cache_size` of them.
    """

    def __init__(self, target: Target, mesh, dump: Dump | None, retrace: RetracePolicy, args: tuple, kwargs: dict):
        self.target = target
        self.region = region_for(target.override.method)
        self.declared = declared_attention(self.region, target)
        self.mesh = mesh
        self.dump = dump
        self.retrace = retrace
        self.programs: OrderedDict[Any, RegionProgram] = OrderedDict()
        self.traces = 0  # signatures traced so far, evicted ones included (the dump numbers variants by it)
        # shared signatures the cp group agreed on; never dropped, unlike graphs: whether a call
        # agrees must depend on what every rank saw, not on what this rank happens to cache
        self.agreed: set[tuple[str, ...]] = set()
        self._build(*self.region.prepare_call(target.fqn, args, kwargs))

    def install(self) -> None:
        module = self.target.module
        module.forward = self
        setattr(module, MARKER, {"fqn": self.target.fqn, "method": self.target.override.method.describe()})

    def __call__(self, *args, **kwargs):
        args, kwargs = self.region.prepare_call(self.target.fqn, args, kwargs)
        leaves, key = flatten_call(self.target.fqn, args, kwargs)
        program = self.programs.get(key)
        if program is None:
            program = self._build(args, kwargs)
        else:
            self.programs.move_to_end(key)  # least recently used goes first
        return program(leaves)

    def _agree_on(self, args: tuple, kwargs: dict) -> None:
        """Have the cp group agree on this call's shared signature, the first time it is seen.

        Every rank meets a new shared signature at the same call (one collective, before the
        region's own); a graph of a known one (another rank-local mask, a graph dropped from the
        cache) is traced without asking.
        """
        shared = shared_signature(args, kwargs)
        if shared not in self.agreed:
            fields = {"region": self.target.fqn, "inputs": ITEM_SEPARATOR.join(shared)}
            agree(self.mesh, f"the inputs of region {self.target.fqn}", fields, CPInputError)
            self.agreed.add(shared)

    @torch.compiler.disable
    def _build(self, args: tuple, kwargs: dict) -> RegionProgram:
        """Trace, rewrite and cache the region for a call signature (args already prepared)."""
        target = self.target
        leaves, key = flatten_call(target.fqn, args, kwargs)
        self._agree_on(args, kwargs)
        self.traces += 1
        self.retrace.note_trace(target.fqn, self.traces, describe_call(args, kwargs))
        ep = trace_region(target.module, self.region.forward, args, kwargs)
        if ep.call_spec.in_spec != key[0]:
            raise RuntimeError(f"{target.fqn}: traced input structure {ep.call_spec.in_spec} differs from the call's {key[0]}")
        program = RegionProgram.from_export(ep, target.module)
        ctx = PassContext(
            fqn=target.fqn,
            method=target.override.method,
            cp_size=self.mesh.cp_size,
            cp_rank=self.mesh.cp_rank,
            group_name=self.mesh.cp_group_name,
            mesh=self.mesh,
            declared=self.declared,
            example_inputs=program.flat_inputs(leaves),
        )
        variant = self.traces - 1
        observer = self.dump.pass_observer(target.fqn, variant) if self.dump else None
        program.gm = run_passes(program.gm, ctx, on_pass=observer)
        if self.dump:
            self.dump.add_region(ctx, program.gm, variant, backend=target.override.method.params.get("backend", "-"))
        self.programs[key] = program
        if len(self.programs) > self.retrace.cache_size:
            self.programs.popitem(last=False)
        return program
