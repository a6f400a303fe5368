"""Exceptions raised while reading a plan or building the device mesh."""
from __future__ import annotations


class PlanError(ValueError):
    """A plan field is invalid. `field` is its path (``plan_overrides[1].when``), `reason` why."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")

    def __reduce__(self):  # keep it picklable across processes despite the 2-argument __init__
        return (type(self), (self.field, self.reason))


class CPConfigError(ValueError):
    """The plan does not fit the running job (world size, mesh shape, sub-group sizes, ...)."""
