"""The local GDN core with the q/k L2 norm inside it, for the eager layer on CUDA
(``kernels.gdn.normalising_core``): an autograd function over the launchers, not a custom op,
because nothing traces it (traced layers keep the stated norm and ``cpcompile::gdn_chunk``).

Forward: one ``l2norm_fwd`` pass each for q and k (fp32 inside, the kernel dtype out), then the
plain forward without ``tinv``. It saves what ``cpcompile::gdn_chunk`` saves, its inputs, except
that q and k are the normalised ones with their fp32 rstd. Backward: prepare again, then the plain
backward, whose last kernel finishes the norm's gradient (``bwd_prepare``'s ``rstd``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import launch


class NormalisingChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float) -> Tensor:
        (qn, q_rstd), (kn, k_rstd) = launch.l2norm_fwd(q), launch.l2norm_fwd(k)
        o, *_ = launch.gdn_fwd(qn, kn, v, g, beta, None, scale, store_tinv=False)
        ctx.save_for_backward(qn, kn, v, g, beta, q_rstd, k_rstd)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        qn, kn, v, g, beta, q_rstd, k_rstd = ctx.saved_tensors
        gc, w, u, tinv = launch.fwd_prepare(kn, v, g, beta)
        dq, dk, dv, dg, dbeta, _ = launch.gdn_bwd(qn, kn, v, g, beta, None, gc, w, u, tinv,
                                                  do.to(v.dtype).contiguous(), None, ctx.scale,
                                                  rstd=(q_rstd, k_rstd))
        return dq, dk, dv, dg, dbeta, None
