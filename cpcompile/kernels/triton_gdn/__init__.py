"""cpcompile's own Triton kernels for the Gated DeltaNet core.

Importing this package does not import triton: ``capability`` and ``chain`` are pure PyTorch;
``ops`` (which registers the ``cpcompile::gdn_*`` custom ops), ``backend`` (the ``triton`` backend of
``cpcompile.gdn_ops``), ``launch`` and ``kernels`` load
triton and are imported on first attribute access.
"""

import importlib

from .capability import GDNCapabilityError, check, check_device, check_environment, check_inputs, require_triton
from .chain import chain_grad_step, chain_step

_LAZY = ("ops", "launch", "kernels", "backend")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)


__all__ = ["GDNCapabilityError", "chain_grad_step", "chain_step", "check", "check_device", "check_environment", "check_inputs",
           "require_triton", *_LAZY]
