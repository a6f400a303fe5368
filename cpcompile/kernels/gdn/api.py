"""One entry point for the GDN core over both backends.

``chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state,
use_qk_l2norm_in_kernel, backend)`` follows transformers' Qwen3.5 convention: q, k ``[B,T,Hk,K]``,
v ``[B,T,Hv,V]``, g (log decay) and beta ``[B,T,Hv]``, state ``[B,Hv,K,V]``; returns
``(o [B,T,Hv,V], final_state fp32 or None)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import CHUNK_SIZE, check_backend


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "triton",
) -> tuple[Tensor, Tensor | None]:
    """Chunked gated delta rule (chunks of ``CHUNK_SIZE``). ``backend="eager"`` runs the pure-PyTorch oracle,
    ``backend="triton"`` cpcompile's Triton kernels (capability-checked, no fallback)."""
    check_backend(backend)
    if backend == "eager":
        from .eager import chunk_gated_delta_rule_eager

        return chunk_gated_delta_rule_eager(
            q, k, v, g, beta, chunk_size=CHUNK_SIZE, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    from .triton.capability import check_inputs, require_triton

    check_inputs(q, k, v, g, beta, initial_state)
    require_triton()
    from .triton import ops as _ops  # noqa: F401  (registers torch.ops.cpcompile.gdn_*)

    if use_qk_l2norm_in_kernel:
        # one Triton pass each (fwd and bwd); the same formula in eager PyTorch was measured at
        # 0.78 ms for q and k at T=16K on an H200, ~40% of the whole forward
        q = torch.ops.cpcompile.gdn_l2norm(q)[0]
        k = torch.ops.cpcompile.gdn_l2norm(k)[0]
    if scale is None:
        scale = k.shape[-1] ** -0.5
    o, final_state, *_ = torch.ops.cpcompile.gdn_chunk_fwd(q, k, v, g, beta, initial_state, float(scale))
    return o, (final_state if output_final_state else None)
