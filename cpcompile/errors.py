"""The errors cpcompile raises for a user to act on: one base, `CPCompileError`.

Each class also derives from the builtin a caller would catch for it, so `except ValueError`
(or `NotImplementedError`, `RuntimeError`) keeps working:

| class | builtin | raised when |
|---|---|---|
| `PlanError` | ValueError | a plan field is invalid; `field` is its path, `reason` why |
| `CPConfigError` | ValueError | the plan does not fit the job: world size, mesh, cp size, sub-groups |
| `CoverageError` | ValueError | an attention core lies in no region, or a region runs no core of its method's kind |
| `CPInputError` | ValueError | a model, call, batch, wrapper parameter or kernel input CP cannot serve |
| `UnsupportedMaskError` | ValueError | an attention mask other than causal∧key-padding or key-padding alone |
| `UnsupportedError` | NotImplementedError | a combination not supported yet (TP/PP/EP with CP), or no registered method |
| `AlreadyCompiledError` | RuntimeError | a module is compiled a second time |
| `GDNCapabilityError` | RuntimeError | the Triton GDN backend cannot run here; `capability` names what is missing |

Internal invariants (a pass that broke a graph) stay `AssertionError` / `RuntimeError`, and a
wrong argument type stays `TypeError`.
"""
from __future__ import annotations


class CPCompileError(Exception):
    """Base of every error cpcompile raises for a user to act on."""


class PlanError(CPCompileError, ValueError):
    """A plan field is invalid. `field` is its path (``plan_overrides[1].when``), `reason` why."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")

    def __reduce__(self):  # keep it picklable across processes despite the 2-argument __init__
        return (type(self), (self.field, self.reason))


class CPConfigError(CPCompileError, ValueError):
    """The plan does not fit the running job (world size, mesh shape, sub-group sizes, ...)."""


class CoverageError(CPCompileError, ValueError):
    """With CP>1 every attention core must lie in exactly one region of a method for its kind."""


class CPInputError(CPCompileError, ValueError):
    """An input CP cannot serve: the model (head counts, shapes), a call (cache, packed sequences),
    the batch, a wrapper's parameters, or a kernel's tensors. The message names the cause."""


class UnsupportedMaskError(CPInputError):
    """An attention mask whose pattern a CP rewrite cannot rebuild globally (sliding window,
    packed documents, additive float masks)."""


class UnsupportedError(CPCompileError, NotImplementedError):
    """Something cpcompile does not support yet (TP, PP or EP beside CP; a method or model
    adapter nobody registered)."""


class AlreadyCompiledError(CPCompileError, RuntimeError):
    """`compile` was asked to rewrite a module it already rewrote."""


class GDNCapabilityError(CPCompileError, RuntimeError):
    """The Triton GDN backend cannot run these inputs here. ``capability`` names what is missing."""

    def __init__(self, capability: str, reason: str):
        self.capability = capability
        self.reason = reason
        super().__init__(f"GDN triton backend: unsupported {capability}: {reason}")

    def __reduce__(self):
        return (type(self), (self.capability, self.reason))
