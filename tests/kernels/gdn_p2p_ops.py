"""The State-P2P kernel pieces as custom ops (namespace ``cpcompile_test``), so a test can run the
chain between them on one process and check every piece against the eager oracle.

Test-only: the library's State-P2P executor (``cpcompile.kernels.gdn.triton.p2p_executor``) calls
the same launch functions directly, inside the layer-level ``cpcompile::gdn_p2p_chunk``.

- ``gdn_p2p_fwd_summary(k, v, g, beta)``: before ``H_in`` arrives -> ``M, S, gc, w, u, tinv, hbuf``;
- ``gdn_p2p_fwd_output(q, k, gc, w, u, hbuf, h_in, scale)``: after -> ``o``;
- ``gdn_p2p_bwd_summary(q, k, w, gc, do, scale)``: before ``dH_out`` arrives -> ``dH_local, M^T, dvl``;
- ``gdn_p2p_bwd_finish(...)``: after -> ``dq, dk, dv, dg, dbeta``.

Each has a fake implementation; none has autograd.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cpcompile.kernels.gdn.common import CHUNK_SIZE
from cpcompile.kernels.gdn.triton import launch
from cpcompile.kernels.gdn.triton.capability import check_device


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.contiguous() if t is not None else None


def _nt(T: int) -> int:
    return (T + CHUNK_SIZE - 1) // CHUNK_SIZE


@torch.library.custom_op("cpcompile_test::gdn_p2p_fwd_summary", mutates_args=())
def gdn_p2p_fwd_summary(k: Tensor, v: Tensor, g: Tensor, beta: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (M fp32 [B,Hv,K,K], S fp32 [B,Hv,K,V], gc, w, u, tinv, hbuf); ``H_out = M H_in + S``.
    ``hbuf`` [B, cdiv(NT, HS), Hv, K, K+V]: entering states ``[P | h0]`` of every HS-th chunk
    (``launch.p2p_hstride``)."""
    check_device(k.device.type, k.device.index)
    M, S, saved = launch.p2p_fwd_summary(_c(k), _c(v), _c(g), _c(beta), store_tinv=True)  # for the finish
    return (M.contiguous(), S.contiguous(), *saved)


@gdn_p2p_fwd_summary.register_fake
def _(k, v, g, beta):
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    f32 = torch.float32
    return (k.new_empty(B, Hv, K, K, dtype=f32), k.new_empty(B, Hv, K, V, dtype=f32),
            k.new_empty(B, T, Hv, dtype=f32), k.new_empty(B, T, Hv, K), k.new_empty(B, T, Hv, V),
            k.new_empty(B, T, Hv, CHUNK_SIZE, dtype=f32),
            k.new_empty(B, launch.triton_cdiv(_nt(T), launch.p2p_hstride(B, Hv, V, _nt(T), k.dtype, k.device)),
                        Hv, K, K + V))


@torch.library.custom_op("cpcompile_test::gdn_p2p_fwd_output", mutates_args=())
def gdn_p2p_fwd_output(q: Tensor, k: Tensor, gc: Tensor, w: Tensor, u: Tensor, hbuf: Tensor, h_in: Tensor,
                       scale: float) -> Tensor:
    """Output given the incoming state ``h_in`` fp32 [B,Hv,K,V], from the summary's saved tensors."""
    check_device(q.device.type, q.device.index)
    return launch.p2p_output(_c(q), _c(k), _c(w), _c(u), _c(gc), _c(hbuf), h_in.float().contiguous(), scale)


@gdn_p2p_fwd_output.register_fake
def _(q, k, gc, w, u, hbuf, h_in, scale):
    return q.new_empty(u.shape)


@torch.library.custom_op("cpcompile_test::gdn_p2p_bwd_summary", mutates_args=())
def gdn_p2p_bwd_summary(q: Tensor, k: Tensor, w: Tensor, gc: Tensor, do: Tensor, scale: float
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dH_local fp32 [B,Hv,K,V], M^T fp32 [B,Hv,K,K], dvl fp32 [B,T,Hv,V]).
    ``dH_in = dH_local + M^T dH_out``; ``dvl`` (intra-chunk d(vn)) goes to the finish."""
    check_device(q.device.type, q.device.index)
    dh_local, mt, dvl = launch.p2p_bwd_summary(_c(q), _c(k), _c(w), _c(gc), _c(do), scale)
    return dh_local.contiguous(), mt.contiguous(), dvl


@gdn_p2p_bwd_summary.register_fake
def _(q, k, w, gc, do, scale):
    B, T, Hk, K = k.shape
    Hv, V = do.shape[2], do.shape[3]
    f32 = torch.float32
    return q.new_empty(B, Hv, K, V, dtype=f32), q.new_empty(B, Hv, K, K, dtype=f32), do.new_empty(do.shape, dtype=f32)


@torch.library.custom_op("cpcompile_test::gdn_p2p_bwd_finish", mutates_args=())
def gdn_p2p_bwd_finish(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, gc: Tensor, w: Tensor, u: Tensor,
                       tinv: Tensor, do: Tensor, h_in: Optional[Tensor], dvl: Tensor, dh_out: Optional[Tensor],
                       scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dg, dbeta) once the incoming state and the leaving-state gradient are known."""
    check_device(q.device.type, q.device.index)
    return launch.p2p_bwd_finish(_c(q), _c(k), _c(v), _c(g), _c(beta), _c(gc), _c(w), _c(u), _c(tinv), _c(do),
                                 h_in, {"dvl": _c(dvl)}, dh_out, scale)


@gdn_p2p_bwd_finish.register_fake
def _(q, k, v, g, beta, gc, w, u, tinv, do, h_in, dvl, dh_out, scale):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta))
