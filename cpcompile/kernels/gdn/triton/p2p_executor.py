"""State-P2P on the Triton kernels for one rank of a ring, forward and backward (GDN RFC §6.4.2-6.4.3).

Forward, rank r of P:   irecv H_in from r-1  |  summary (M, S)  ->  wait H_in  ->  isend M·H_in + S to r+1
                        ->  output from H_in  ->  wait the send.
Backward:               irecv dH_out from r+1  |  state-gradient summary (dH_local, Mᵀ)
                        ->  wait dH_out  ->  isend dH_local + Mᵀ·dH_out to r-1  ->  finish (the plain
                        backward from H_in and dH_out). Rank 0 sends nothing back: no summary; the
                        finish's work that needs no dH_out runs before its wait instead.

Only fp32 states and the small `M·H + S` / `Mᵀ·dH` products are serial between ranks; everything
else runs while the neighbour is busy. Rank 0 has no entering state: it runs the plain forward and
sends its final state as soon as its state pass is done. The last rank sends nothing forward, rank 0
nothing backward; every receive has exactly one matching send, so no rank waits on a message that
is never sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from ..summary import chain_grad_step, chain_step
from . import launch
from .capability import cast_and_check


@dataclass(frozen=True)
class Ring:
    """This rank's place in the CP group and its neighbours' global ranks (None at the ends)."""

    group: dist.ProcessGroup
    rank: int
    world: int

    @classmethod
    def of(cls, group_name: str, rank: int, world: int) -> "Ring":
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
        if dist.get_rank(group) != rank or dist.get_world_size(group) != world:
            raise RuntimeError(
                f"GDN State-P2P: the region was built for rank {rank} of {world} in group {group_name!r}, "
                f"but this process is rank {dist.get_rank(group)} of {dist.get_world_size(group)}")
        return cls(group, rank, world)

    def _peer(self, offset: int) -> int | None:
        peer = self.rank + offset
        return dist.get_global_rank(self.group, peer) if 0 <= peer < self.world else None

    def post_recv(self, like: Tensor, offset: int):
        """Post a receive of a tensor shaped like `like` from rank r+offset -> (buffer, work) or None."""
        peer = self._peer(offset)
        if peer is None:
            return None
        buffer = torch.empty_like(like, dtype=torch.float32, memory_format=torch.contiguous_format)
        return buffer, dist.irecv(buffer, src=peer, group=self.group)

    def send(self, tensor: Tensor, offset: int):
        peer = self._peer(offset)
        return None if peer is None else dist.isend(tensor.contiguous(), dst=peer, group=self.group)


def _received(posted) -> Tensor | None:
    if posted is None:
        return None
    buffer, work = posted
    _wait(work)
    return buffer


def _wait(work) -> None:
    """Wait for a message, as a named range on a profiler timeline (benchmarks/gdn_p2p_timeline.py)."""
    with record_function("gdn_p2p.wait"):
        work.wait()


def _state_like(k: Tensor, v: Tensor) -> Tensor:
    B, Hv, K, V = k.shape[0], v.shape[2], k.shape[3], v.shape[3]
    return k.new_empty(B, Hv, K, V, dtype=torch.float32)


def p2p_forward(q, k, v, g, beta, scale: float, chunk_size: int, ring: Ring) -> tuple[Tensor, Tensor]:
    """-> (o in q's dtype, entering state H_in fp32 — zeros on rank 0 — kept for the backward)."""
    qd, kd = cast_and_check(q, k, v, g, beta, None, chunk_size)
    qd, kd, v, g, beta = (x.contiguous() for x in (qd, kd, v, g, beta))
    incoming = ring.post_recv(_state_like(kd, v), -1)
    if incoming is None:  # rank 0: plain forward; its final state leaves after the state pass
        gc, w, u, _ = launch.fwd_prepare(kd, v, g, beta, store_tinv=False)
        hbuf, vnbuf, h_out = launch.fwd_state(kd, w, u, gc, None)
        sent = ring.send(h_out, +1)
        o = launch.fwd_output(qd, kd, gc, hbuf, vnbuf, scale)
        h_in = torch.zeros_like(h_out)
    else:
        with record_function("gdn_p2p_fwd.local_summary"):
            m, s, saved = launch.p2p_fwd_summary(kd, v, g, beta)
        with record_function("gdn_p2p_fwd.chain"):
            h_in = _received(incoming)
            sent = ring.send(chain_step(m, s, h_in), +1)
        with record_function("gdn_p2p_fwd.output"):
            o = launch.p2p_fwd_output(qd, kd, saved, h_in, scale)
    if sent is not None:
        _wait(sent)  # the send buffer must outlive the transfer
    return o.to(q.dtype), h_in


def p2p_backward(do, q, k, v, g, beta, h_in, scale: float, chunk_size: int, ring: Ring) -> list[Tensor]:
    """-> [dq, dk, dv, dg, dbeta] in their inputs' dtypes; exchanges the state gradient on the ring."""
    qd, kd = cast_and_check(q, k, v, g, beta, None, chunk_size)
    qd, kd, v, g, beta = (x.contiguous() for x in (qd, kd, v, g, beta))
    do = do.to(v.dtype).contiguous()
    # the phases are named on a profiler timeline (docs/gdn.md: where the chain sits)
    with record_function("gdn_p2p_bwd.local_summary"):
        incoming = ring.post_recv(h_in, +1)
        gc, w, u, tinv = launch.fwd_prepare(kd, v, g, beta)
        # buffers for the finish travel in a dict it empties, so each is freed after its last reader
        if ring.rank > 0:
            dh_local, m_t, dvl = launch.p2p_bwd_summary(qd, kd, w, gc, do, scale)
            held = {"dvl": dvl}
            del dvl
        else:  # sends nothing back, so nothing waits on it: the finish's part that needs no dH_out
            # fills its wait (as long as the other ranks' summaries; docs/gdn.md)
            held = {"dvl": launch.bwd_dv_local(qd, kd, gc, do, scale),
                    "hbuf": launch.p2p_bwd_states(kd, w, u, gc, h_in)}
    with record_function("gdn_p2p_bwd.chain"):
        dh_out = _received(incoming)
        sent = None
        if ring.rank > 0:
            sent = ring.send(chain_grad_step(m_t.mT, dh_local, dh_out), -1)
    with record_function("gdn_p2p_bwd.finish"):
        grads = launch.p2p_bwd_finish(qd, kd, v, g, beta, gc, w, u, tinv, do, h_in, held, dh_out, scale,
                                      qk_grad_dtype=q.dtype if q.dtype == k.dtype else None)
        if sent is not None:
            _wait(sent)
    return [grad.to(x.dtype).contiguous() for grad, x in zip(grads, (q, k, v, g, beta))]
