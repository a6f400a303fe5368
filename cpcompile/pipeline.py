"""The pipeline behind `cpcompile.compile`: match → probe → trace → rewrite → install, atomically.

Each region's replacement forward, which traces and rewrites it, is `installed_region.InstalledRegion`;
the checks of the probe forward (coverage, sequence mixers, the example's positions) are
`audit/coverage.py`; the cut audit `audit/cuts.py`.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn as nn

from .agreement import ITEM_SEPARATOR, NOT_REACHED, agree, agree_on_outcome, plan_fields
from .audit.config import config_hazards, refuse_router_aux_loss, refuse_router_aux_loss_call
from .audit.coverage import attention_hint, check_coverage, check_mixers, refuse_example_without_positions
from .audit.cuts import cut_audit
from .capture import probe_forward
from .documents import DocumentFeed
from .dump import Dump, resolve_dump_dir
from .errors import AlreadyCompiledError, CoverageError, CPConfigError, CPInputError, PlanError, UnsupportedError
from .installed_region import MARKER, InstalledRegion, Target
from .meta_params import example_device, fake_parameters, has_meta_parameters
from .methods import method_spec
from .passes.backward_schedule import enable_for_groups
from .plan import Override, load_plan
from .region import RetracePolicy
from .rope import find_call_dependent_rotaries, install_step_rope
from .rope import state_kept as rope_state_kept
from .sequence_layout import LayoutGuard
from .tp import check_tp_applied, find_tp_linears

log = logging.getLogger("cpcompile")

PROBE_LENGTH = 16


def compile(model: nn.Module, mesh, plan, *, dump_dir=None, example_inputs: Any = None,
            trace_cache_size: int | None = None) -> nn.Module:
    """Rewrite every attention region the plan names into its CP form, in place.

    `example_inputs` is one *local* batch as this rank will feed the model (a dict of
    keyword arguments, or a tuple of positional ones); for a Hugging Face model it may be
    omitted and a small batch of token ids is used (pass the real shapes to avoid tracing
    twice). Every check runs before any module is changed: on error the model's modules are
    left as they were (sub-groups a method needs may already have been created; the probe
    forward runs without gradients on a forked random stream).

    The model's parameters may be on the meta device (built to be sharded, then loaded): the
    probe and the traces then run on fake parameters on the example's device, and the model is
    left with its meta parameters (`meta_params.py`); pass `example_inputs` on that device.

    `dump_dir` (else `CPCOMPILE_DUMP_DIR`): the debug dump (docs/debugging.md); in a job of more
    than one process each rank writes `<dump_dir>/rank<r>`, r its global rank (`dump.resolve_dump_dir`).

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
        refuse_empty_plan(plan)
        log.info("cpcompile: no active plan overrides (cp_size=%d); model left unchanged", plan.cp_size)
        return model
    reject_unsupported_combinations(plan, overrides)
    check_tp_applied(model, plan.accelerator.tp_size)
    plan.layout()  # one batch has one sequence layout: refuse overrides that need different ones
    targets = resolve_targets(model, overrides)
    agree(mesh, "the plan", plan_fields(plan, targets), CPConfigError)  # before the first collective
    build_subgroups(mesh, overrides)
    tp_linears = {t.fqn: find_tp_linears(t.fqn, t.module, mesh) for t in targets}  # before the probe runs them
    example = example_inputs if example_inputs is not None else default_example(model)
    refuse_example_without_positions(model, example)
    dump = Dump(root) if (root := resolve_dump_dir(dump_dir)) else None
    documents = DocumentFeed()
    if isinstance(example, dict):  # a packed example traces the regions that read documents for it
        documents.update(example.get("position_ids"))
    # From the probe to the last rewrite, a step may fail on this rank's own data (its mask, its
    # positions) and on no other: nothing here communicates, and the outcome is agreed once at the
    # end, so that every rank raises the same error or none does (agreement.agree_on_outcome).
    installs: list[InstalledRegion] = []
    compared = 0  # values the cut audit compared
    signatures = {t.fqn: NOT_REACHED for t in targets}
    # RoPE choosing its frequencies from the call: refused, or chosen from the step's longest position (rope.py)
    rotaries = find_call_dependent_rotaries(model, [t.fqn for t in targets])
    refuse_router_aux_loss(model)
    try:
        with parameters_for_compile(model, example):
            with rope_state_kept(rotaries):
                probe = probe_forward(model, example, {t.fqn: t.module for t in targets})
            check_coverage(targets, probe.core_sites, dict(model.named_modules()), attention_hint(model))
            check_mixers(probe)
            for target in targets:
                args, kwargs = probe.inputs[target.fqn]
                installed = InstalledRegion(target, mesh, dump, retrace, args, kwargs, tp_linears[target.fqn], documents)
                signatures[target.fqn] = ITEM_SEPARATOR.join(installed.first_signature)
                installs.append(installed)
            compared = cut_audit(model, example, probe.tokens, {i.target.fqn: i.reads for i in installs},
                                 {f.fqn for f in rotaries}, lambda: rope_state_kept(rotaries))
        failure = None
    except Exception as exc:  # noqa: BLE001 -- re-raised below, on every rank, once the group agreed
        failure = exc
    fields = {f"inputs of region {fqn}": signature for fqn, signature in signatures.items()}
    agree_on_outcome(mesh, "compiling the regions", fields, failure, CPInputError)
    for installed in installs:
        installed.agreed.add(installed.first_signature)
    hazards = config_hazards(model, {i.target.fqn: i.declared for i in installs}, rotaries, probe.mixers_audited,
                             compared)
    for hazard in hazards:
        log.info("cpcompile: %s", hazard.describe())
    if dump:
        dump.set_hazards([hazard.as_dict() for hazard in hazards])
    for installed in installs:  # nothing above touched the model; from here on nothing can fail
        installed.install()
    install_step_rope(rotaries, mesh)
    schedule_async_backward(mesh, overrides)
    reads_batch_marks = any(installed.reads_documents or installed.reads_global_positions for installed in installs)
    guard = LayoutGuard(mesh.cp_size, mesh.cp_rank, plan.layout(), every_call=reads_batch_marks)
    install_layout_guard(model, guard, documents)
    hand_documents_to_layers(model, [i.target.fqn for i in installs if i.reads_documents or i.reads_unmasked], documents)
    return model


def parameters_for_compile(model: nn.Module, example: Any):
    """A model whose parameters are on the meta device (built for a sharded load) is probed and
    traced with fake parameters on the example's device (`meta_params.py`); any other as it is."""
    if not has_meta_parameters(model):
        return contextlib.nullcontext()
    return fake_parameters(model, example_device(example))


def hand_documents_to_layers(model: nn.Module, fqns: list[str], documents: DocumentFeed) -> None:
    """Have the layers around regions that read the document feed (GDN, attention) pass each call's
    documents down as keywords (`DocumentFeed.hand_to_layer`), so that a checkpointed layer's replay
    reads the documents of its own forward. Only layers whose forward takes `**kwargs` (Hugging Face decoder
    layers) can; a region called without the keyword reads the feed."""
    for name in sorted({fqn.rpartition(".")[0] for fqn in fqns if "." in fqn}):
        layer = model.get_submodule(name)
        parameters = inspect.signature(layer.forward).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            layer.register_forward_pre_hook(documents.hand_to_layer, with_kwargs=True)


def install_layout_guard(model: nn.Module, guard: LayoutGuard, documents: DocumentFeed | None = None) -> None:
    """Check every call's `position_ids` against this rank's slice of the plan's layout
    (`sequence_layout.LayoutGuard`), for a model that takes them: a token-batch model, such as a Hugging
    Face causal LM (a module taking, say, q, k and v has no batch layout to check). The same
    hook hands a packed batch's position ids to the regions that read them (`documents`)."""
    parameters = list(inspect.signature(model.forward).parameters)
    if "position_ids" not in parameters:
        return
    index = parameters.index("position_ids")

    @torch.compiler.disable  # a Python check of the call, not part of the model's graph
    def check(_module, args, kwargs):
        refuse_router_aux_loss_call(kwargs)
        position_ids = kwargs["position_ids"] if "position_ids" in kwargs else (args[index] if len(args) > index else None)
        guard.check(position_ids)
        if documents is not None:
            documents.update(position_ids)

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


def refuse_empty_plan(plan) -> None:
    """A plan with no override at CP>1 would leave every attention unrewritten: a rank fed its
    slice would attend only within it, silently wrong. At cp_size 1 the `when: cp` overrides are
    inactive on purpose (the model is left as it is)."""
    if plan.cp_size > 1:
        raise CoverageError(
            f"cp_size={plan.cp_size} but the plan has no plan_overrides (an empty list, or a blank "
            "`plan_overrides:` line): CP>1 needs an explicit method for every attention core; unrewritten, "
            "each rank would attend only within its own slice of the sequence"
        )


def reject_unsupported_combinations(plan, overrides) -> None:
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


def default_example(model: nn.Module) -> dict:
    """Token ids and their positions (a CP model is always called with them: `sequence_layout.LayoutGuard`)."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    if get_embeddings is None:
        raise CPInputError("pass example_inputs=: cpcompile can only make an example batch for Hugging Face models")
    embeddings = get_embeddings()
    ids = torch.randint(0, embeddings.num_embeddings, (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(0))
    ids = ids.to(embeddings.weight.device)
    example = {"input_ids": ids, "use_cache": False}
    if "position_ids" in inspect.signature(model.forward).parameters:
        example["position_ids"] = torch.arange(PROBE_LENGTH, device=ids.device)[None]
    return example
