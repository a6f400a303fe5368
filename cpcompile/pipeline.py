"""The pipeline behind `cpcompile.compile`, atomically, in stages: resolve the plan
(`resolved_plan.py`) → agree on it → prepare the regions → probe and trace them → agree on the
traces → install.

Each region's replacement forward, which traces and rewrites it, is `installed_region.InstalledRegion`;
the checks of the probe forward (coverage, sequence mixers, the example's positions) are
`audit/coverage.py`; the cut audit `audit/cuts.py`.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .agreement import ITEM_SEPARATOR, NOT_REACHED, agree, agree_on_outcome
from .audit.config import config_hazards, refuse_router_aux_loss, refuse_router_aux_loss_call
from .audit.coverage import attention_hint, check_coverage, check_mixers, refuse_example_without_positions
from .audit.cuts import cut_audit
from .capture import probe_forward
from .documents import DocumentFeed
from .dump import Dump, resolve_dump_dir
from .errors import CPConfigError, CPInputError
from .installed_region import InstalledRegion
from .meta_params import example_device, fake_parameters, has_meta_parameters
from .passes.backward_schedule import enable_for_groups
from .plan import load_plan
from .region import RetracePolicy
from .resolved_plan import ResolvedPlan, resolve_plan
from .rope import find_call_dependent_rotaries, install_step_rope
from .rope import state_kept as rope_state_kept
from .sequence_layout import LayoutGuard
from .tp import find_tp_linears

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
    resolved = resolve_plan(model, mesh, plan)
    if not resolved.targets:  # CP=1, or no override active: the model is left as it is
        return model
    agree_on_plan(mesh, resolved)
    regions = prepare_regions(model, mesh, resolved, example_inputs, dump_dir)
    probe_and_trace(model, mesh, retrace, resolved, regions)
    agree_on_traces(mesh, regions)
    install(model, mesh, resolved, regions)
    return model


@dataclass
class Regions:
    """What the probe and the traces of the regions make, for the agreement and the install.

    From the probe to the last trace, a step may fail on this rank's own data (its mask, its
    positions) and on no other: nothing there communicates, so the failure is kept (`failure`) and
    the outcome agreed once at the end, so that every rank raises the same error or none does
    (agreement.agree_on_outcome)."""

    example: Any
    tp_linears: dict[str, list]  # per region, its TP linears (found before the probe runs them)
    dump: Dump | None
    documents: DocumentFeed
    rotaries: list  # RoPE choosing its frequencies from the call (rope.py)
    signatures: dict[str, str]  # per region, its first input signature (NOT_REACHED until traced)
    installs: list[InstalledRegion] = field(default_factory=list)
    mixers_audited: int = 0  # outermost modules the mixer audit called again
    compared: int = 0  # values the cut audit compared
    failure: Exception | None = None


def agree_on_plan(mesh, resolved: ResolvedPlan) -> None:
    """Every rank holds the same plan and model, checked before the first collective that needs
    it; then every sub-group a method needs is created, on all ranks in one order.

    `new_group` is collective; a region re-traced later (a new input shape) may do so on one
    rank only, so passes must find their groups already built and cached in the mesh.
    """
    agree(mesh, "the plan", resolved.agreement_fields(), CPConfigError)
    for degree in resolved.subgroup_degrees:
        mesh.cp_subgroups(degree)


def prepare_regions(model: nn.Module, mesh, resolved: ResolvedPlan, example_inputs, dump_dir) -> Regions:
    """The checks before the probe that need the example or the model, not a trace; -> `Regions`."""
    tp_linears = {t.fqn: find_tp_linears(t.fqn, t.module, mesh) for t in resolved.targets}
    example = example_inputs if example_inputs is not None else default_example(model)
    refuse_example_without_positions(model, example)
    dump = Dump(root) if (root := resolve_dump_dir(dump_dir)) else None
    documents = DocumentFeed()
    if isinstance(example, dict):  # a packed example traces the regions that read documents for it
        documents.update(example.get("position_ids"))
    # RoPE choosing its frequencies from the call: refused, or chosen from the step's longest position (rope.py)
    rotaries = find_call_dependent_rotaries(model, [t.fqn for t in resolved.targets])
    refuse_router_aux_loss(model)
    return Regions(example, tp_linears, dump, documents, rotaries, {t.fqn: NOT_REACHED for t in resolved.targets})


def probe_and_trace(model: nn.Module, mesh, retrace: RetracePolicy, resolved: ResolvedPlan, regions: Regions) -> None:
    """The probe forward and its checks, each region's trace and rewrite, then the cut audit;
    a failure is kept in `regions.failure` (`Regions`)."""
    targets, example, rotaries = resolved.targets, regions.example, regions.rotaries
    try:
        with parameters_for_compile(model, example):
            with rope_state_kept(rotaries):
                probe = probe_forward(model, example, {t.fqn: t.module for t in targets})
            check_coverage(list(targets), probe.core_sites, dict(model.named_modules()), attention_hint(model))
            check_mixers(probe)
            regions.mixers_audited = probe.mixers_audited
            for target in targets:
                args, kwargs = probe.inputs[target.fqn]
                installed = InstalledRegion(target, mesh, regions.dump, retrace, args, kwargs,
                                            regions.tp_linears[target.fqn], regions.documents)
                regions.signatures[target.fqn] = ITEM_SEPARATOR.join(installed.first_signature)
                regions.installs.append(installed)
            regions.compared = cut_audit(model, example, probe.tokens, {i.target.fqn: i.reads for i in regions.installs},
                                         {f.fqn for f in rotaries}, lambda: rope_state_kept(rotaries))
    except Exception as exc:  # noqa: BLE001 -- re-raised by agree_on_traces, on every rank, once the group agreed
        regions.failure = exc


def agree_on_traces(mesh, regions: Regions) -> None:
    """Every rank traced every region, with the same input signatures, or every rank raises."""
    fields = {f"inputs of region {fqn}": signature for fqn, signature in regions.signatures.items()}
    agree_on_outcome(mesh, "compiling the regions", fields, regions.failure, CPInputError)
    for installed in regions.installs:
        installed.agreed.add(installed.first_signature)


def install(model: nn.Module, mesh, resolved: ResolvedPlan, regions: Regions) -> None:
    """Report the configuration's hazards, then replace the regions' forwards and install what runs
    around them (step RoPE, the async backward schedule, the layout guard, the documents)."""
    installs = regions.installs
    hazards = config_hazards(model, {i.target.fqn: i.declared for i in installs}, regions.rotaries,
                             regions.mixers_audited, regions.compared)
    for hazard in hazards:
        log.info("cpcompile: %s", hazard.describe())
    if regions.dump:
        regions.dump.set_hazards([hazard.as_dict() for hazard in hazards])
    for installed in installs:  # nothing before touched the model; from here on nothing can fail
        installed.install()
    install_step_rope(regions.rotaries, mesh)
    schedule_async_backward(mesh, resolved)
    reads_batch_marks = any(installed.reads_documents or installed.reads_global_positions for installed in installs)
    guard = LayoutGuard(mesh.cp_size, mesh.cp_rank, resolved.layout, every_call=reads_batch_marks)
    install_layout_guard(model, guard, regions.documents)
    hand_documents_to_layers(model, [i.target.fqn for i in installs if i.reads_documents or i.reads_unmasked],
                             regions.documents)


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


def schedule_async_backward(mesh, resolved: ResolvedPlan) -> None:
    """Under `torch.compile` (Inductor), the backward graphs talking on an async region's groups
    get the forward's schedule too (`passes/backward_schedule.py`); eager backward is unchanged."""
    if not resolved.asynchronous:
        return
    groups = {mesh.cp_group_name}
    for degree in resolved.async_subgroup_degrees:
        groups.update(g.group_name for g in mesh.cp_subgroups(degree))
    enable_for_groups(groups)


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
