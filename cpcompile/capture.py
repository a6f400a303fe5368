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
from .methods import core_module_kind

@dataclass
class ProbeResult:
    inputs: dict[str, tuple[tuple, dict]] = field(default_factory=dict)
    # one entry per core call: (core kind, FQNs of the modules it ran inside, outermost first)
    core_sites: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    # modules outside the regions found mixing sequence positions: one chain per outermost one
    mixers: list[list[Mixer]] = field(default_factory=list)
    mixers_report: str = ""
    mixers_audited: int | None = None  # outermost modules the audit called again (None: skipped)


class _RecordSdpaCalls(TorchFunctionMode):
    def __init__(self, stack: list[str], sites: list):
        super().__init__()
        self.stack, self.sites = stack, sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.sites.append(("sdpa", tuple(self.stack)))
        # Answered with zeros, like the stubbed GDN layers: the probe needs the calls' sites and the
        # regions' inputs, not attention values. Running it would cost the whole local attention at
        # the probe's dtype: fp32 parameters with grouped KV heads send SDPA to its math kernel,
        # whose [heads, S_local, S_local] scores are 512 GiB at 128K local tokens.
        query = args[0] if args else kwargs["query"]
        value = args[2] if len(args) > 2 else kwargs["value"]
        return query.new_zeros(*query.shape[:-1], value.shape[-1])


@contextmanager
def _module_stack_hooks(model: nn.Module, stack: list[str], sites: list):
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
def _module_cores_stubbed(model: nn.Module):
    """Module-type cores (GDN layers) answer the probe with zeros instead of running.

    The probe needs only their call inputs, and their library forward may dispatch to kernels
    that cannot run here (transformers sends Qwen3.5's GDN to fla-core when it is installed,
    which fails on a CPU-only machine); cpcompile never runs that forward for a CP region.
    """
    stubbed = [m for m in model.modules() if core_module_kind(m) is not None]

    def zeros_like_input(hidden_states=None, *args, **kwargs):
        return torch.zeros_like(hidden_states if hidden_states is not None else kwargs["hidden_states"])

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


def probe_forward(model: nn.Module, example: Any, regions: dict[str, nn.Module]) -> ProbeResult:
    """One forward (no grad) recording region inputs and where each core runs, auditing the modules
    outside the regions for sequence mixing on the way (`audit.mixers`)."""
    result = ProbeResult()
    stack: list[str] = []
    # forked RNG: the probe must not change the random stream the user's training sees
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad(), _module_stack_hooks(model, stack, result.core_sites), \
            _record_first_inputs(regions, result.inputs), _module_cores_stubbed(model), \
            mixer_audit(model, list(regions), example) as audit:
        with _RecordSdpaCalls(stack, result.core_sites):
            if isinstance(example, dict):
                model(**example)
            elif isinstance(example, (tuple, list)):
                model(*example)
            else:
                model(example)
    if audit is not None:
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
