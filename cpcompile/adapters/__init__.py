"""Model adapters: how cpcompile recognises, calls and traces model-specific attention cores."""
from __future__ import annotations

from torch import nn

from ..methods import CPMethod


def core_module_kind(module: nn.Module) -> str | None:
    """The core kind a module *is* (cores found by module type rather than by an op call)."""
    from .qwen3_5 import is_gdn_layer

    return "gdn" if is_gdn_layer(module) else None


def region_for(method: CPMethod):
    """The object that prepares calls of, and traces, a region rewritten by `method`."""
    if method.core == "sdpa":
        from .sdpa import SdpaRegion

        return SdpaRegion()
    adapter = method.params.get("adapter")
    if adapter == "qwen3_5_gdn":
        from .qwen3_5 import GdnRegion

        return GdnRegion(method)
    raise NotImplementedError(f"no region adapter for {method.describe()}")
