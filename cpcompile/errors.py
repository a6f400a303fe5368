"""The errors cpcompile raises for a user to act on: one base, `CPCompileError`.

Each class also derives from the builtin a caller would catch for it, so `except ValueError`
(or `NotImplementedError`, `RuntimeError`) keeps working:

| class | builtin | raised when |
|---|---|---|
| `PlanError` | ValueError | a plan field is invalid; `field` is its path, `reason` why |
| `CPConfigError` | ValueError | the plan does not fit the job (world size, mesh, cp size, sub-groups); an unwritable `dump_dir`; a checkpoint a run cannot resume, a damaged dump summary |
| `CoverageError` | ValueError | an attention core lies in no region, a region runs no core of its method's kind, or a module outside the regions mixes sequence positions |
| `CPInputError` | ValueError | a model, call, batch, wrapper parameter or kernel input CP cannot serve |
| `UnsupportedMaskError` | ValueError | an attention mask other than causal∧key-padding or key-padding alone |
| `UnsupportedError` | NotImplementedError | a combination not supported yet (PP/EP with CP, TP with GDN, TP applied after compile), or no registered method |
| `AlreadyCompiledError` | RuntimeError | a module is compiled a second time |
| `GDNCapabilityError` | RuntimeError | the Triton GDN backend cannot run here; `capability` names what is missing |
| `VerificationError` | RuntimeError | a CP run differs from its reference beyond its tolerance (`train` with `verify: true`) |
| `MissingDependencyError` | ImportError | a package a feature needs is not installed; the message names the pip extra |
| `CheckpointError` | RuntimeError | a checkpoint could not be saved (disk full, read-only, no permission: the message names the cause) or its files are not what the save wrote |
| `NonFiniteError` | FloatingPointError | a step's loss or gradient norm is NaN or Inf (`cpcompile train`), or, with `CPCOMPILE_CHECK_FINITE=1`, a region's output or input gradient (`finite.py`) |

Internal invariants (a pass that broke a graph) stay `AssertionError` / `RuntimeError`, and a
wrong argument type stays `TypeError`.

A value shown in a message goes through `short_repr`, so an error never grows with its input (a
plan value may be a huge or deeply shared structure); `PlanError` also clips its field and reason.
"""
from __future__ import annotations

import reprlib

MAX_VALUE_CHARS = 200  # one value shown in a message
MAX_MESSAGE_CHARS = 2000  # a whole PlanError reason

_BOUNDED = reprlib.Repr()  # reprlib stops at a depth and a width, so huge inputs cost little
_BOUNDED.maxlevel, _BOUNDED.maxstring, _BOUNDED.maxother, _BOUNDED.maxlong = 2, 80, 80, 40


def clip(text: str, limit: int) -> str:
    """`text`, cut to about `limit` characters with a note of how much was left out."""
    if len(text) <= limit:
        return text
    keep = max(limit - 32, 0)
    return f"{text[:keep]}... ({len(text) - keep} more characters)"


def short_repr(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """`repr(value)` for an error message: bounded in size and cost, whatever `value` holds."""
    try:
        text = _BOUNDED.repr(value)
    except ValueError:  # an int too long to print (sys.set_int_max_str_digits)
        text = f"<{type(value).__name__} of {value.bit_length()} bits>" if isinstance(value, int) else "<?>"
    except Exception:  # a broken __repr__ must not hide the error being reported
        text = f"<{type(value).__name__} object>"
    return clip(text, limit)


class CPCompileError(Exception):
    """Base of every error cpcompile raises for a user to act on."""


class PlanError(CPCompileError, ValueError):
    """A plan field is invalid. `field` is its path (``plan_overrides[1].when``), `reason` why."""

    def __init__(self, field: str, reason: str):
        self.field = clip(str(field), MAX_VALUE_CHARS)
        self.reason = clip(str(reason), MAX_MESSAGE_CHARS)
        super().__init__(f"{self.field}: {self.reason}")

    def __reduce__(self):  # keep it picklable across processes despite the 2-argument __init__
        return (type(self), (self.field, self.reason))


class CPConfigError(CPCompileError, ValueError):
    """The plan does not fit the running job (world size, mesh shape, sub-group sizes, ...), or the
    job cannot do what it was asked (write the debug dump to `dump_dir`, resume a checkpoint, read
    a dump's summary)."""


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


class VerificationError(CPCompileError, RuntimeError):
    """A CP run checked against its reference (`cpcompile train` with `verify: true`) differs by
    more than its tolerance; the message says where and by how much."""


class MissingDependencyError(CPCompileError, ImportError):
    """A package a feature needs is not installed; the message names the extra that brings it."""


class NonFiniteError(CPCompileError, FloatingPointError):
    """A value training computed is NaN or Inf: a step's loss or gradient norm (the trainer stops
    there), or, with ``CPCOMPILE_CHECK_FINITE=1``, a CP region's output or input gradient. The
    message names the step, and the region where there is one."""


class CheckpointError(CPCompileError, RuntimeError):
    """A checkpoint could not be saved or read back: the message names the cause (disk full and
    how much was needed, a read-only folder, a permission, a damaged or foreign file) and what
    is left to resume from."""
