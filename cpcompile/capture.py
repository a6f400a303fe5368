"""Capture: find where attention cores run, record region inputs, trace regions.

`probe_forward` runs the model once on an example batch and records, for every module
the plan targets, the inputs of its first call (their shapes and dtypes are what matter: SDPA calls
and GDN layers answer the probe with zeros), and, for every SDPA call, the stack of modules it
ran inside. `trace_region` then exports one module (non-strict
`torch.export`) from recorded inputs, through the forward its region adapter names (for SDPA
the module class's own `forward`, so a module cpcompile already changed can be traced again).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .audit.mixers import Mixer, mixer_audit
from .audit.tokens import TokenBatch, from_layer_input, from_sdpa_call, from_shapes
from .methods import core_module_kind

@dataclass
class ProbeResult:
    inputs: dict[str, tuple[tuple, dict]] = field(default_factory=dict)
    # one entry per core call: (core kind, FQNs of the modules it ran inside, outermost first)
    core_sites: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    # modules outside the regions found mixing sequence positions: one chain per outermost one
    mixers: list[list[Mixer]] = field(default_factory=list)
    mixers_report: str = ""
    mixers_audited: int = 0  # outermost modules the audit called again
    tokens: TokenBatch | None = None  # the local batch, as the first attention core saw it


def _no_note(_tokens: TokenBatch) -> None:
    return None


class _RecordSdpaCalls(TorchFunctionMode):
    """Answers every SDPA call with zeros; records its module stack in `sites` (when given) and its
    local batch through `on_core`."""

    def __init__(self, stack: list[str] | None = None, sites: list | None = None,
                 on_core: Callable[[TokenBatch], None] = _no_note):
        super().__init__()
        self.stack, self.sites, self.on_core = stack, sites, on_core

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query = args[0] if args else kwargs["query"]
        value = args[2] if len(args) > 2 else kwargs["value"]
        if self.sites is not None:
            self.sites.append(("sdpa", tuple(self.stack)))
        self.on_core(from_sdpa_call(query))
        # Answered with zeros, like the stubbed GDN layers: the probe needs the calls' sites and the
        # regions' inputs, not attention values. Running it would cost the whole local attention at
        # the probe's dtype: fp32 parameters with grouped KV heads send SDPA to its math kernel,
        # whose [heads, S_local, S_local] scores are 512 GiB at 128K local tokens.
        return query.new_zeros(*query.shape[:-1], value.shape[-1])


@contextmanager
def module_stack_hooks(model: nn.Module, stack: list[str], sites: list):
    """While inside: `stack` holds the FQNs of the modules running, outermost first; each call of a
    module-type core (a GDN layer) appends (its kind, the stack) to `sites`."""
    handles = []
    for name, module in model.named_modules():
        kind = core_module_kind(module)

        def push(_m, _a, name=name, kind=kind):
            stack.append(name)
            if kind is not None:
                sites.append((kind, tuple(stack)))

        def pop(_m, _a, _o):
            stack.pop()

        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _record_first_inputs(modules: dict[str, nn.Module], into: dict):
    def recorder(fqn):
        def hook(_m, args, kwargs):
            into.setdefault(fqn, (args, dict(kwargs)))
        return hook

    handles = [m.register_forward_pre_hook(recorder(fqn), with_kwargs=True) for fqn, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _module_cores_stubbed(model: nn.Module, on_core: Callable[[TokenBatch], None] = _no_note):
    """Module-type cores (GDN layers) answer the probe with zeros instead of running (and tell
    `on_core` their local batch).

    The probe needs only their call inputs, and their library forward may dispatch to kernels
    that cannot run here (transformers sends Qwen3.5's GDN to fla-core when it is installed,
    which fails on a CPU-only machine); cpcompile never runs that forward for a CP region.
    """
    stubbed = [m for m in model.modules() if core_module_kind(m) is not None]

    def zeros_like_input(hidden_states=None, *args, **kwargs):
        hidden_states = hidden_states if hidden_states is not None else kwargs["hidden_states"]
        on_core(from_layer_input(hidden_states))
        return torch.zeros_like(hidden_states)

    saved = {module: module.__dict__.get("forward") for module in stubbed}
    for module in stubbed:
        module.forward = zeros_like_input
    try:
        yield
    finally:
        for module, forward in saved.items():
            if forward is None:
                del module.forward
            else:
                module.forward = forward


@contextmanager
def cores_answered_with_zeros(model: nn.Module):
    """Every attention core of `model` (SDPA calls, GDN layers) answers with zeros while inside."""
    with _module_cores_stubbed(model), _RecordSdpaCalls():
        yield


def forked_rng():
    """A random stream of its own for a forward cpcompile runs at `compile`: the user's training must
    see the stream it would have without cpcompile."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=cuda)


def call_model(model: nn.Module, example: Any) -> Any:
    """`model` called with the example batch: keyword arguments, positional ones, or one input."""
    if isinstance(example, dict):
        return model(**example)
    if isinstance(example, (tuple, list)):
        return model(*example)
    return model(example)


def probe_forward(model: nn.Module, example: Any, regions: dict[str, nn.Module]) -> ProbeResult:
    """One forward (no grad) recording region inputs and where each core runs, auditing the modules
    outside the regions for sequence mixing on the way (`audit.mixers`)."""
    result = ProbeResult()
    stack: list[str] = []
    with forked_rng(), torch.no_grad(), module_stack_hooks(model, stack, result.core_sites), \
            _record_first_inputs(regions, result.inputs), mixer_audit(model, list(regions)) as audit:

        def note_core(tokens: TokenBatch) -> None:
            if result.tokens is None:
                result.tokens = tokens
                audit.set_tokens(tokens)

        with _module_cores_stubbed(model, note_core), _RecordSdpaCalls(stack, result.core_sites, note_core):
            call_model(model, example)
        if result.tokens is None and result.inputs:  # regions with no attention core: a local_compute_fn's
            note_core(from_shapes(example, next(iter(result.inputs.values()))))
    result.mixers, result.mixers_report, result.mixers_audited = audit.found, audit.report(), len(audit.audited)
    return result


class _TracedForward(nn.Module):
    """Holds the region module as `target` and calls `forward(target, ...)` for export."""

    def __init__(self, target: nn.Module, forward: Callable[..., Any]):
        super().__init__()
        self.target = target
        self._forward = forward

    def forward(self, *args, **kwargs):
        return self._forward(self.target, *args, **kwargs)


PREFIX = "target."


def trace_region(module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict,
                 dynamic_shapes: Any = None) -> torch.export.ExportedProgram:
    # (inside a checkpointed forward, `InstalledRegion` shields this from the checkpoint's saved-tensor hooks)
    return torch.export.export(_TracedForward(module, forward), tuple(args), dict(kwargs), strict=False,
                               dynamic_shapes=dynamic_shapes)
