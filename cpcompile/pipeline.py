"""The pipeline behind `cpcompile.compile`: match → probe → trace → rewrite → install, atomically."""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections import OrderedDict
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn as nn
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree

from .agreement import ITEM_SEPARATOR, NOT_REACHED, agree, agree_on_outcome, plan_fields
from .audit.config import config_hazards, refuse_router_aux_loss, refuse_router_aux_loss_call
from .audit.cuts import cut_audit
from .audit.local_length import find_local_length_reads
from .batch import LayoutGuard
from .capture import probe_forward, trace_region
from .compiled import add_code_entry, regions_inlined, room_for_every_entry
from .context import DeclaredAttention, PassContext
from .documents import DOCUMENTS_KWARG, QUERY_POSITIONS, DocumentFeed
from .dump import Dump, resolve_dump_dir
from .errors import AlreadyCompiledError, CoverageError, CPConfigError, CPInputError, PlanError, UnsupportedError
from .finite import FiniteGuard, check_finite_enabled
from .meta_params import example_device, fake_parameters, has_meta_parameters
from .methods import method_spec, region_for
from .methods.local_compute import LOCAL_CORE
from .passes import run_passes
from .passes.backward_schedule import enable_for_groups
from .plan import Override, load_plan
from .region import RegionProgram, RetracePolicy, describe_call, flatten_call, shared_signature
from .rope import find_call_dependent_rotaries, install_step_rope
from .rope import state_kept as rope_state_kept
from .tp import check_tp_applied, find_tp_linears, full_gradients_for_replicated_params, local_tp_view, tp_size

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

    The model's parameters may be on the meta device (built to be sharded, then loaded): the
    probe and the traces then run on fake parameters on the example's device, and the model is
    left with its meta parameters (`meta_params.py`); pass `example_inputs` on that device.

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
    hand_documents_to_layers(model, [i.target.fqn for i in installs if i.reads_documents], documents)
    return model


def parameters_for_compile(model: nn.Module, example: Any):
    """A model whose parameters are on the meta device (built for a sharded load) is probed and
    traced with fake parameters on the example's device (`meta_params.py`); any other as it is."""
    if not has_meta_parameters(model):
        return contextlib.nullcontext()
    return fake_parameters(model, example_device(example))


def hand_documents_to_layers(model: nn.Module, fqns: list[str], documents: DocumentFeed) -> None:
    """Have the layers around regions that read the document feed (GDN) pass each call's documents
    down as a keyword (`DocumentFeed.hand_to_layer`), so that a checkpointed layer's replay reads the
    documents of its own forward. Only layers whose forward takes `**kwargs` (Hugging Face decoder
    layers) can; a region called without the keyword reads the feed."""
    for name in sorted({fqn.rpartition(".")[0] for fqn in fqns if "." in fqn}):
        layer = model.get_submodule(name)
        parameters = inspect.signature(layer.forward).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            layer.register_forward_pre_hook(documents.hand_to_layer, with_kwargs=True)


def install_layout_guard(model: nn.Module, guard: LayoutGuard, documents: DocumentFeed | None = None) -> None:
    """Check every call's `position_ids` against this rank's slice of the plan's layout
    (`batch.LayoutGuard`), for a model that takes them: a token-batch model, such as a Hugging
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


# attributes that number a layer without changing what its code does
LAYER_NUMBERS = frozenset({"layer_idx", "layer_id", "layer_number"})
# audit/local_length.py's findings, by region kind, module identity and call with the length left out,
# for the whole process (least recently used dropped first)
LENGTH_AUDITS: OrderedDict = OrderedDict()
LENGTH_AUDITS_KEPT = 64


def module_identity(module: nn.Module) -> tuple:
    """What a module's forward does depends on: its classes, their plain attributes (a layer's
    `use_rope`, `sliding_window`, ...) but not its layer number, the configs they hold (as text),
    and their parameter shapes."""
    plain = (bool, int, float, str, type(None))
    parts = []
    for name, sub in module.named_modules():
        attrs = tuple(sorted((k, v if isinstance(v, plain) else repr(sorted(v.to_dict().items())))
                             for k, v in vars(sub).items()
                             if (isinstance(v, plain) or callable(getattr(v, "to_dict", None)))
                             and k not in LAYER_NUMBERS and not k.startswith("_")))
        params = tuple((k, tuple(p.shape), p.dtype) for k, p in sub.named_parameters(recurse=False))
        parts.append((name, type(sub), attrs, params))
    return tuple(parts)


def length_free_signature(key: tuple, length: int) -> tuple:
    """A call's signature (`region.flatten_call`) with the local length taken out: every tensor
    dimension and plain value equal to it becomes None."""
    spec, described, autocast = key

    def free(entry):
        if entry[0] == "tensor":
            return ("tensor", tuple(None if d == length else d for d in entry[1]), *entry[2:])
        return (entry[0], None) if entry[1] == length and entry[0] == "int" else entry
    return spec, tuple(free(entry) for entry in described), autocast


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
    """A model taking `position_ids` is always called with them under CP (`batch.LayoutGuard`), and
    without them it numbers each rank's tokens from 0: an example without them would be audited
    (audit/cuts.py) and traced on a call that never happens."""
    if not isinstance(example, dict) or example.get("position_ids") is not None:
        return
    if "position_ids" in inspect.signature(model.forward).parameters:
        raise CPInputError(
            f"example_inputs has no position_ids, which {type(model).__name__} takes: a CP model is always called "
            "with the global positions of its tokens (without them it would number each rank's slice from 0); pass "
            "the local batch cpcompile.shard_batch returns as example_inputs")


def default_example(model: nn.Module) -> dict:
    """Token ids and their positions (a CP model is always called with them: `batch.LayoutGuard`)."""
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


def inputs_read(ep: torch.export.ExportedProgram, args: tuple, kwargs: dict) -> dict[str, bool]:
    """For each leaf of the traced call (by its pytree path): whether the graph reads it. A plain value
    (an int, a flag) counts as read: the trace is specialised on it."""
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]]
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user = [spec for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    if len(user) != len(paths):
        return {}
    return {path: not isinstance(spec.arg, TensorArgument) or bool(placeholders[spec.arg.name].users)
            for path, spec in zip(paths, user)}


def declared_attention(region, target: Target) -> DeclaredAttention:
    """What the region's modules declare about their attention, for adapters that read it (SDPA)."""
    read = getattr(region, "declared_attention", None)
    return read(target.fqn, target.module) if read is not None else DeclaredAttention()


@contextlib.contextmanager
def _saving_nothing_for_checkpoints():
    """Tracing a new signature runs (fake) tensor ops that autograd records. Inside a
    `torch.utils.checkpoint` forward those would be counted as the layer's saved tensors, and the
    recompute, which finds the graph cached, would save fewer: the checkpoint refuses the
    mismatch. Hooks that keep tensors as they are, pushed innermost, take those ops out of the
    checkpoint's count (and cost nothing outside a checkpoint).

    A selective checkpoint (`create_selective_checkpoint_contexts`) also records the forward's
    ops through a dispatch mode and hands their saved outputs to the recompute in order: the
    trace's ops would be among them (fake tensors handed to the recompute's matmuls). So the
    trace runs with the dispatch modes set aside when one of them is a selective checkpoint's."""
    with _outside_selective_checkpoint(), torch.autograd.graph.saved_tensors_hooks(_unchanged, _unchanged):
        yield


def _outside_selective_checkpoint():
    # private names (in every torch we support, >= 2.11): PyTorch has no public way to step out of an active mode
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import _CachingTorchDispatchMode

    if any(isinstance(mode, _CachingTorchDispatchMode) for mode in _get_current_dispatch_mode_stack()):
        return _disable_current_modes()
    return contextlib.nullcontext()


def _unchanged(tensor):
    return tensor


_warned_not_inlined = False  # a region called inside torch.compile, not inlined, was logged (once a process)


class InstalledRegion:
    """The replacement `forward`: one rewritten graph per input signature.

    A call whose input signature (structure, shapes, dtypes, non-tensor values, autocast state)
    was not seen before is traced and rewritten then, before it runs; errors surface the same
    way. The graphs are kept least recently used first, at most `retrace.cache_size` of them.
    """

    def __init__(self, target: Target, mesh, dump: Dump | None, retrace: RetracePolicy, args: tuple, kwargs: dict,
                 tp_linears: list | None = None, documents: DocumentFeed | None = None):
        add_code_entry()  # under `torch.compile` each region's `_run` is an entry of one code object
        self.target = target
        self.region = region_for(target.override.method)
        if hasattr(self.region, "bind"):  # a region that needs its module and the mesh (local_compute_fn)
            self.region.bind(target, mesh)
        # a region whose call lacks the position ids (GDN) takes a packed batch's from the model's hook;
        # a Head-Tail SDPA region reads a batch cut per document off its own call (adapters/sdpa.py)
        self.reads_documents = getattr(self.region, "reads_documents", False)
        self.reads_global_positions = getattr(self.region, "reads_global_positions", False)
        self.documents = documents or DocumentFeed()
        self.declared = declared_attention(self.region, target)
        self.mesh = mesh
        self.tp_linears = tp_linears or []  # tensor-parallel linears in the region (tp.py)
        self.dump = dump
        self.retrace = retrace
        self.programs: OrderedDict[Any, RegionProgram] = OrderedDict()
        self.traces = 0  # signatures traced so far, evicted ones included (the dump numbers variants by it)
        # shared signatures the cp group agreed on; never dropped, unlike graphs: whether a call
        # agrees must depend on what every rank saw, not on what this rank happens to cache
        self.agreed: set[tuple[str, ...]] = set()
        self.finite_guard = FiniteGuard(target.fqn, mesh)  # CPCOMPILE_CHECK_FINITE=1 (finite.py)
        self.reads: dict[str, bool] = {}  # the first traced call's inputs (by path): does the graph read each

        args, kwargs = self._prepare(args, kwargs)
        # at compile the group agrees on every region's first signature and outcome at once (`compile`)
        self.first_signature = shared_signature(args, kwargs)
        self._build(args, kwargs, agree_now=False)

    def install(self) -> None:
        module = self.target.module
        module.forward = self
        setattr(module, MARKER, {"fqn": self.target.fqn, "method": self.target.override.method.describe()})

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        handed = DOCUMENTS_KWARG in kwargs  # a handed None means one document per row
        positions = kwargs.pop(DOCUMENTS_KWARG, None)
        args, kwargs = self.region.prepare_call(self.target.fqn, args, kwargs)
        if self.reads_documents:
            # whether the last call's documents came down from its layer (else: the feed's, the latest call's);
            # not recorded under torch.compile, which refuses a side effect inside a checkpointed layer
            if not torch.compiler.is_compiling():
                self.documents_handed = handed
            kwargs = {**kwargs, "document_positions": positions if handed else self.documents.positions}
        if self.reads_global_positions and kwargs.get(QUERY_POSITIONS) is None \
                and self.documents.global_positions is not None and torch._C._current_graph_task_id() == -1:
            raise CPInputError(
                f"{self.target.fqn}: the batch is packed and cut per document for Head-Tail, but this attention's "
                "call does not carry the position_ids shard_batch marked (the model rebuilt or dropped them); "
                "per-document Head-Tail needs them, use a contiguous method for this model")
        return args, kwargs

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() and not regions_inlined():
            return self._run_as_own_graph(*args, **kwargs)
        return self._run(*args, **kwargs)

    @torch.compiler.disable(recursive=False)
    def _run_as_own_graph(self, *args, **kwargs):
        """Under `torch.compile` but not `compile_around_regions`: the caller's graph ends here on
        every rank, and the region runs as graphs of its own (what it calls is compiled apart);
        why not inlined: `cpcompile.compiled`."""
        global _warned_not_inlined
        if not _warned_not_inlined:
            _warned_not_inlined = True
            log.warning("cpcompile: CP regions (first: %s) are called inside torch.compile: the compiled graph breaks "
                        "around each (inside an activation checkpoint the whole checkpointed layer runs eagerly). "
                        "Compile code around CP regions with cpcompile.compiled.compile_around_regions for one graph "
                        "with the regions inside. Logged once.", self.target.fqn)
        with room_for_every_entry():  # else past 8 regions the rest would run uncompiled
            return self._run(*args, **kwargs)

    def _run(self, *args, **kwargs):
        args, kwargs = self._prepare(args, kwargs)
        leaves, key = flatten_call(self.target.fqn, args, kwargs)
        program = self.programs.get(key)
        if program is None:
            program = self._build(args, kwargs, inlined=torch.compiler.is_compiling() and regions_inlined())
        elif not torch.compiler.is_compiling():  # compiled code looks its graph up once, when traced
            self.programs.move_to_end(key)  # least recently used goes first
        if check_finite_enabled():
            return self.finite_guard.around(leaves, program)
        return program(leaves)

    @torch.compiler.disable  # an export and the passes: Dynamo breaks the graph here
    def _build(self, args: tuple, kwargs: dict, agree_now: bool = True, inlined: bool = False) -> RegionProgram:
        if inlined:  # by compile_around_regions, whose eager first call should have traced it
            log.warning("cpcompile: %s met a new input signature inside compile_around_regions (%s; its graph was "
                        "dropped from the region's cache, or the signature depends on more than the compiled "
                        "call's): the compiled graph breaks here", self.target.fqn, ", ".join(describe_call(args, kwargs)))
        with _saving_nothing_for_checkpoints():
            return self._build_agreed(args, kwargs, agree_now)

    def _build_agreed(self, args: tuple, kwargs: dict, agree_now: bool) -> RegionProgram:
        """Trace, rewrite and cache the region for a call signature (args already prepared).

        A shared signature not seen before is met by every rank at the same call: the trace and
        the passes run without communicating, then the group agrees on the signature and on the
        outcome in one gather before the region's own collectives, so a refusal found on one
        rank's data (its mask) is raised on every rank (`agreement.agree_on_outcome`). A graph of
        a known shared signature (another rank-local mask, a graph dropped from the cache) is
        traced without asking: this rank may be alone in tracing it.
        """
        shared = shared_signature(args, kwargs)
        if not agree_now or shared in self.agreed:
            return self._trace_and_rewrite(args, kwargs)
        program, failure = None, None
        try:
            program = self._trace_and_rewrite(args, kwargs)
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank once the group agreed
            failure = exc
        fields = {"region": self.target.fqn, "inputs": ITEM_SEPARATOR.join(shared)}
        agree_on_outcome(self.mesh, f"the inputs of region {self.target.fqn}", fields, failure, CPInputError)
        self.agreed.add(shared)
        return program

    def _length_reads(self, args: tuple, kwargs: dict) -> list:
        """The ops of the region's module that read the local sequence length, from a second trace
        with that length symbolic (audit/local_length.py); [] for regions running cpcompile's own
        statement of a layer (GDN) and for one local token (a trace cannot keep a size of 1 symbolic)."""
        if not getattr(self.region, "audits_local_length", False):
            return []
        hidden = next((leaf for leaf in pytree.tree_leaves((args, kwargs))
                       if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() == 3), None)
        if hidden is None or hidden.shape[1] < 2:
            return []
        # The audit's trace keeps the length symbolic, so its finding holds for every length of a call
        # otherwise alike, and for every module alike (the layers of one model, the same model compiled
        # again): a new length (the usual re-trace) and the next layer reuse it instead of another
        # export (~1 s each on a CPU).
        key = (type(self.region), module_identity(self.target.module),
               length_free_signature(flatten_call(self.target.fqn, args, kwargs)[1], hidden.shape[1]))
        reads = LENGTH_AUDITS.get(key)
        if reads is None:
            with local_tp_view(self.tp_linears):
                reads = find_local_length_reads(self.target.module, self.region.forward, args, kwargs,
                                                hidden.shape[0], hidden.shape[1])
            LENGTH_AUDITS[key] = reads
            if len(LENGTH_AUDITS) > LENGTH_AUDITS_KEPT:
                LENGTH_AUDITS.popitem(last=False)
        LENGTH_AUDITS.move_to_end(key)
        return reads

    def _trace_and_rewrite(self, args: tuple, kwargs: dict) -> RegionProgram:
        target = self.target
        leaves, key = flatten_call(target.fqn, args, kwargs)
        self.traces += 1
        self.retrace.note_trace(target.fqn, self.traces, describe_call(args, kwargs))
        with local_tp_view(self.tp_linears):  # a TP rank's local computation (tp.py)
            ep = trace_region(target.module, self.region.forward, args, kwargs)
        if not self.reads:
            self.reads = inputs_read(ep, args, kwargs)
        call_spec = pytree.tree_structure((tuple(args), dict(kwargs)))
        if ep.call_spec.in_spec != call_spec:
            raise RuntimeError(f"{target.fqn}: traced input structure {ep.call_spec.in_spec} differs from the call's {call_spec}")
        program = RegionProgram.from_export(ep, target.module, target.fqn, frozenset(t.module for t in self.tp_linears))
        if self.tp_linears:
            program.gm = full_gradients_for_replicated_params(program.gm, program, self.tp_linears[0].group_name)
        ctx = PassContext(
            length_reads=self._length_reads(args, kwargs),
            fqn=target.fqn,
            method=target.override.method,
            cp_size=self.mesh.cp_size,
            cp_rank=self.mesh.cp_rank,
            group_name=self.mesh.cp_group_name,
            mesh=self.mesh,
            declared=self.declared,
            tp_size=tp_size(self.tp_linears),
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
