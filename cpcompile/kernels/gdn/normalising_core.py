"""The eager CUDA layer's GDN core with its q/k L2 norm inside (issue 48 item 5).

Qwen3.5 states the q/k norm in float32 (`common.l2norm` on an fp32 copy, kept fp32), and the
triton core casts q and k back to bf16 and returns q's dtype, fp32, which the layer casts back to
bf16. Run eagerly, each layer pays for that in every forward, replay and backward: fp32 copies of q,
k and the core's output, the norm's unfused multiplies (six more in its backward) and the casts
back. Here one Triton pass normalises each of q and k (fp32 inside, the kernel dtype out: the
rounding of the fp32 norm followed by the cast), the backward finishes the norm's gradient inside
the core's last kernel, and the output comes back in v's dtype.

Only the untraced eager layer takes it (`applies`). Traced layers keep the stated norm and
`cpcompile::gdn_chunk`: a CP rewrite finds that op in its graph, and inductor fuses the norm
with the conv around it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .common import reset_decay_at_starts
from .inputs import check_starts


def applies(x: Tensor, backend: str) -> bool:
    """The `triton` backend on CUDA, run eagerly: neither Dynamo nor `torch.export` traces the call."""
    return backend == "triton" and x.is_cuda and not torch.compiler.is_compiling()


def chunk_normalising_qk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                         chunk_size: int, starts: Tensor | None = None) -> Tensor:
    """The core output `[B, T, Hv, V]` in v's dtype, for raw (unnormalised) q and k: what
    `cpcompile::gdn_chunk` returns for `l2norm(q.float())`, `l2norm(k.float())`, up to rounding."""
    from .triton.capability import cast_and_check
    from .triton.normalising_core import NormalisingChunk

    check_starts(starts, g)
    q, k = cast_and_check(q, k, v, g, beta, None, chunk_size)  # contiguous, in the kernel dtype
    if starts is not None:
        g = reset_decay_at_starts(g, starts)
    v, g, beta = (x.contiguous() for x in (v, g, beta))  # the kernels index rows densely
    return NormalisingChunk.apply(q, k, v, g, beta, scale)
