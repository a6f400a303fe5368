"""The Gated DeltaNet (GDN) core, one folder per algorithm (as flash-linear-attention keeps them):

- ``common``  backend names, the chunk length, the q/k L2 norm — stated once;
- ``api``     ``chunk_gated_delta_rule``: one entry point over both backends;
- ``layer_ops`` the layer-level ``cpcompile::gdn_*`` custom ops the Qwen3.5 adapter traces and the
              GDN rewrites emit (fake implementation + autograd each);
- ``naive``   the token recurrence: the oracle every other form is checked against;
- ``inputs``  the input checks, compute dtype and head-major layout ``naive`` and ``eager`` share;
- ``eager``   the pure-PyTorch backend (chunkwise form, segment summaries, the local state gradient);
- ``summary`` the affine algebra of segment summaries ``H_out = M @ H_in + S``;
- ``conv``    the layer's causal depthwise conv before the core: ``F.conv1d``, or its taps under
              ``torch.compile`` and within packed documents, or (triton backend, eager, CUDA)
              ``cpcompile::gdn_conv``, registered by ``conv_ops`` (kernels: ``triton/conv``);
- ``normalising_core`` the eager CUDA layer's core with the q/k L2 norm inside (kernels:
              ``triton/normalising_core``);
- ``triton/`` cpcompile's Triton kernels (the ``triton`` backend).

Importing this package never imports triton, nor registers the custom ops (``layer_ops`` does;
``triton/kernel_ops`` the kernel-level ones).
"""
from .api import chunk_gated_delta_rule
from .common import BACKENDS, CHUNK_SIZE, L2NORM_EPS, check_backend, l2norm

__all__ = ["BACKENDS", "CHUNK_SIZE", "L2NORM_EPS", "check_backend", "chunk_gated_delta_rule", "l2norm"]
