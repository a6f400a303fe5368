"""One entry point for the GDN core over both backends.

``chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state,
use_qk_l2norm_in_kernel, backend, cu_seqlens)`` follows transformers' Qwen3.5 convention: q, k
``[B,T,Hk,K]``, v ``[B,T,Hv,V]``, g (log decay) and beta ``[B,T,Hv]``, state ``[B,Hv,K,V]``; returns
``(o [B,T,Hv,V], final_state fp32 or None)``. ``cu_seqlens`` (``[N+1]``, with B = 1) packs N
documents in the row, as fla-core's argument does: the state resets at each document start.
Per-document initial and final states are not offered (refused).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...documents import starts_from_cu_seq_lens
from ...errors import CPInputError
from .common import CHUNK_SIZE, check_backend, reset_decay_at_starts


def _document_starts(cu_seqlens: Tensor | None, q: Tensor, initial_state: Tensor | None,
                     output_final_state: bool) -> Tensor | None:
    """`[1, T]` bool document starts of `cu_seqlens` (None without it)."""
    if cu_seqlens is None:
        return None
    if initial_state is not None or output_final_state:
        raise CPInputError("chunk_gated_delta_rule: with cu_seqlens, per-document initial and final states are not "
                           "offered; pass initial_state=None and output_final_state=False")
    starts = starts_from_cu_seq_lens(cu_seqlens, q.shape[0], q.shape[1], "chunk_gated_delta_rule: cu_seqlens")
    return starts[None].to(q.device)


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
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunked gated delta rule (chunks of ``CHUNK_SIZE``). ``backend="eager"`` runs the pure-PyTorch oracle,
    ``backend="triton"`` cpcompile's Triton kernels (capability-checked, no fallback)."""
    check_backend(backend)
    starts = _document_starts(cu_seqlens, q, initial_state, output_final_state)
    if backend == "eager":
        from .eager import chunk_gated_delta_rule_eager

        return chunk_gated_delta_rule_eager(
            q, k, v, g, beta, chunk_size=CHUNK_SIZE, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, starts=starts)

    from .triton.capability import check_inputs, require_triton

    check_inputs(q, k, v, g, beta, initial_state)
    require_triton()
    from .triton import kernel_ops as _ops  # noqa: F401  (registers torch.ops.cpcompile.gdn_*)

    if scale is None:
        scale = k.shape[-1] ** -0.5
    if starts is not None:
        g = reset_decay_at_starts(g, starts)
    # the q/k L2 norm runs inside the op (one Triton pass each way; in eager PyTorch it cost 0.78 ms
    # for q and k at T=16K on an H200, ~40% of the whole forward)
    o, final_state, *_ = torch.ops.cpcompile.gdn_chunk_fwd(q, k, v, g, beta, initial_state, float(scale),
                                                           use_qk_l2norm_in_kernel)
    return o, (final_state if output_final_state else None)
