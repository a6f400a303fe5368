"""cpcompile's own Triton kernels for the Gated DeltaNet core.

Importing this package does not import triton: ``capability`` is pure PyTorch; ``kernel_ops``
(which registers the ``cpcompile::gdn_chunk_fwd`` / ``gdn_chunk_bwd`` kernel-level custom ops),
``backend`` (the ``triton`` backend of the layer-level ops, ``cpcompile.kernels.gdn.layer_ops``) and ``launch`` (the entry points over the stage files: ``prepare``,
``state``, ``output``, ``p2p_summary``, ``p2p_output``, ``bwd_state``, ``bwd_inter``,
``bwd_prepare``, ``l2norm``; shared pieces in ``helpers`` and ``launching``) load triton and are
imported on first attribute access. ``conv`` holds the layer's causal conv + SiLU kernels (the op
``cpcompile::gdn_conv`` in ``kernels.gdn.conv_ops`` imports it at its first real call). The State-P2P chain steps are ``cpcompile.kernels.gdn.summary.chain_step`` /
``chain_grad_step``.
"""

import importlib

from .capability import GDNCapabilityError, check, check_device, check_environment, check_inputs, require_triton

_LAZY = ("kernel_ops", "launch", "backend")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)


__all__ = ["GDNCapabilityError", "check", "check_device", "check_environment", "check_inputs",
           "require_triton", *_LAZY]
