"""An installed region: the `forward` that replaces a rewritten module's (`InstalledRegion`), with
one rewritten graph per input signature, traced and rewritten on a signature's first call, and
what it needs around that: which of the call's inputs the graph reads (`inputs_read`), the
local-length audit's cache by module and call (`module_identity`, `length_free_signature`), and the
shields that keep a trace inside an activation checkpoint out of the checkpoint's saved tensors.

`compile` (pipeline.py) builds one per region and installs them once every region is rewritten.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree

from .agreement import ITEM_SEPARATOR, agree_on_outcome
from .audit.local_length import find_local_length_reads
from .capture import trace_region
from .compiled import add_code_entry, regions_inlined, room_for_every_entry
from .context import DeclaredAttention, PassContext
from .documents import DOCUMENTS_KWARG, QUERY_POSITIONS, UNMASKED_KWARG, DocumentFeed
from .dump import Dump
from .errors import CPInputError
from .finite import FiniteGuard, check_finite_enabled
from .methods import region_for
from .passes import run_passes
from .plan import Override
from .region import RegionProgram, RetracePolicy, describe_call, flatten_call, shared_signature
from .tp import full_gradients_for_replicated_params, local_tp_view, tp_size

log = logging.getLogger("cpcompile")

# set on every module whose forward a region replaced: its FQN and method (a second compile refuses it)
MARKER = "_cpcompile_config"


@dataclass
class Target:
    """One region to rewrite: the module whose forward is replaced, and why."""

    fqn: str
    module: nn.Module
    override: Override


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
        # an attention region takes whether the batch's keys are unmasked as a call argument, which keys its graph
        self.reads_unmasked = getattr(self.region, "reads_unmasked", False)
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
        # a bound method, not the object: Dynamo guards a callable object in `forward` on its identity (every
        # layer would compile apart), a bound method on its function and on what the call reads through `self`
        module.forward = self.__call__
        setattr(module, MARKER, {"fqn": self.target.fqn, "method": self.target.override.method.describe()})

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        handed = DOCUMENTS_KWARG in kwargs  # a handed None means one document per row
        positions = kwargs.pop(DOCUMENTS_KWARG, None)
        unmasked = kwargs.pop(UNMASKED_KWARG) if UNMASKED_KWARG in kwargs else self.documents.unmasked
        args, kwargs = self.region.prepare_call(self.target.fqn, args, kwargs)
        if self.reads_documents:
            # whether the last call's documents came down from its layer (else: the feed's, the latest call's);
            # not recorded under torch.compile, which refuses a side effect inside a checkpointed layer
            if not torch.compiler.is_compiling():
                self.documents_handed = handed
            kwargs = {**kwargs, "document_positions": positions if handed else self.documents.positions}
        if self.reads_unmasked:
            kwargs = {**kwargs, UNMASKED_KWARG: unmasked}
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
            unmasked=kwargs.get(UNMASKED_KWARG),
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
