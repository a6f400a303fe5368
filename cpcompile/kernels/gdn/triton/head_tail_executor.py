"""State-P2P in Head-Tail order on the Triton kernels, for one rank, forward and backward.

Rank r of P holds chunk r (head) and chunk 2P−1−r (tail) of the sequence's 2P chunks, folded into
one batch `[2B, c, ...]` (heads' rows, then tails'). Along the sequence the state visits the heads
in rank order, then the tails in reverse rank order, so it goes up the ring and comes back down:

Forward:   irecv H_head from r−1  |  both summaries (M, S)  ->  wait H_head  ->  isend M·H_head + S to
           r+1 (rank P−1: that is its tail's H_tail)  ->  irecv H_tail from r+1  |  head output
           ->  wait H_tail  ->  isend M·H_tail + S to r−1  ->  tail output  ->  wait the sends.
Backward:  irecv dH of the tail's end from r−1  |  both state-gradient summaries  ->  wait  ->
           isend dH_local + Mᵀ·dH to r+1 (rank P−1: its head's dH_out)  ->  irecv the head's from r+1
           |  tail finish  ->  wait  ->  isend to r−1  ->  head finish  ->  wait the sends.

Each fragment's output (finish) runs as soon as its state (state gradient) is known, while the
other's is on its way. A pair of ranks exchanges one message each way per pass, and each rank posts
a receive from a neighbour only after its own send to that neighbour: NCCL runs one pair's messages
in the order they are posted, so the reverse order would wait on a message that is sent only after
it. Rank 0's head has no entering state (zeros), and its tail's leaving state goes nowhere.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.profiler import record_function

from ..summary import chain_grad_step, chain_step
from . import launch
from .capability import cast_and_check
from .p2p_executor import Ring, _received, _wait

UP, DOWN = +1, -1  # neighbours: rank r+1 (the heads' direction), rank r−1 (the tails')


def _halves(x: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """The head rows and the tail rows of a folded `[2B, ...]` tensor (None stays None)."""
    if x is None:
        return None, None
    half = x.shape[0] // 2
    return x[:half], x[half:]


def _rows(saved: tuple, slot: int) -> tuple:
    return tuple(_halves(x)[slot] for x in saved)


def head_tail_forward(q, k, v, g, beta, scale: float, chunk_size: int, ring: Ring) -> tuple[Tensor, Tensor]:
    """-> (o `[2B, c, Hv, V]` in q's dtype, the fragments' entering states fp32 `[2B, Hv, K, V]`)."""
    qd, kd = cast_and_check(q, k, v, g, beta, None, chunk_size)
    qd, kd, v, g, beta = (x.contiguous() for x in (qd, kd, v, g, beta))
    B, T, Hv, V = v.shape[0] // 2, v.shape[1], v.shape[2], v.shape[3]
    state_like = kd.new_empty(B, Hv, kd.shape[3], V, dtype=torch.float32)
    # one stride for the summary of both fragments and each fragment's output
    hstride = launch.p2p_hstride(B, Hv, V, launch.triton_cdiv(T, launch.CHUNK_SIZE), kd.dtype, kd.device)
    from_below = ring.post_recv(state_like, DOWN)
    with record_function("gdn_p2p_ht_fwd.local_summary"):
        m, s, saved = launch.p2p_fwd_summary(kd, v, g, beta, hstride=hstride)
    (m_head, m_tail), (s_head, s_tail) = _halves(m), _halves(s)
    with record_function("gdn_p2p_ht_fwd.head_chain"):
        h_head = _received(from_below)
        h_head = torch.zeros_like(state_like) if h_head is None else h_head
        after_head = chain_step(m_head, s_head, h_head)
        sent_up = ring.send(after_head, UP)
        from_above = ring.post_recv(state_like, UP)  # after the send to the same neighbour (NCCL order)
    with record_function("gdn_p2p_ht_fwd.head_output"):
        o_head = launch.p2p_fwd_output(qd[:B], kd[:B], _rows(saved, 0), h_head, scale, hstride)
    with record_function("gdn_p2p_ht_fwd.tail_chain"):
        h_tail = after_head if from_above is None else _received(from_above)
        sent_down = ring.send(chain_step(m_tail, s_tail, h_tail), DOWN)
    with record_function("gdn_p2p_ht_fwd.tail_output"):
        o_tail = launch.p2p_fwd_output(qd[B:], kd[B:], _rows(saved, 1), h_tail, scale, hstride)
    for sent in (sent_up, sent_down):
        if sent is not None:
            _wait(sent)  # the send buffers must outlive the transfers
    return torch.cat([o_head, o_tail]).to(q.dtype), torch.cat([h_head, h_tail])


def head_tail_backward(do, q, k, v, g, beta, h_in, scale: float, chunk_size: int, ring: Ring) -> list[Tensor]:
    """-> [dq, dk, dv, dg, dbeta] (folded, in their inputs' dtypes); exchanges the state gradients."""
    qd, kd = cast_and_check(q, k, v, g, beta, None, chunk_size)
    qd, kd, v, g, beta = (x.contiguous() for x in (qd, kd, v, g, beta))
    do = do.to(v.dtype).contiguous()
    B = v.shape[0] // 2
    state_like = h_in[:B]
    from_below = ring.post_recv(state_like, DOWN)  # the gradient of the state leaving the tail
    with record_function("gdn_p2p_ht_bwd.local_summary"):
        gc, w, u, tinv = launch.fwd_prepare(kd, v, g, beta)
        dh_local, m_t, dvl = launch.p2p_bwd_summary(qd, kd, w, gc, do, scale)
    (local_head, local_tail), (mt_head, mt_tail) = _halves(dh_local), _halves(m_t)
    tensors = (qd, kd, v, g, beta, gc, w, u, tinv, do, h_in)
    # each finish takes its half of dvl (emptying its dict) and drops it after its state pass: the
    # buffer goes once both have
    held_head, held_tail = ({"dvl": half} for half in _halves(dvl))
    del dvl
    with record_function("gdn_p2p_ht_bwd.tail_chain"):
        out_tail = _received(from_below)  # None on rank 0: its tail ends the sequence
        into_tail = chain_grad_step(mt_tail.mT, local_tail, out_tail)
        sent_up = ring.send(into_tail, UP)
        from_above = ring.post_recv(state_like, UP)  # after the send to the same neighbour (NCCL order)
    with record_function("gdn_p2p_ht_bwd.tail_finish"):
        grads_tail = _finish(tensors, 1, held_tail, out_tail, scale, q, k)
    with record_function("gdn_p2p_ht_bwd.head_chain"):
        out_head = into_tail if from_above is None else _received(from_above)
        sent_down = ring.send(chain_grad_step(mt_head.mT, local_head, out_head), DOWN)
    with record_function("gdn_p2p_ht_bwd.head_finish"):
        grads_head = _finish(tensors, 0, held_head, out_head, scale, q, k)
        for sent in (sent_up, sent_down):
            if sent is not None:
                _wait(sent)
    return [torch.cat([h, t]).to(x.dtype).contiguous() for h, t, x in zip(grads_head, grads_tail, (q, k, v, g, beta))]


def _finish(tensors: tuple, slot: int, held: dict, dh_out: Tensor | None, scale: float, q: Tensor, k: Tensor) -> tuple:
    """The plain backward of one fragment's rows from its entering state and the gradient of its
    leaving state (None: zero); `held`: its rows of the summary's dvl."""
    qd, kd, v, g, beta, gc, w, u, tinv, do, h_in = _rows(tensors, slot)
    return launch.p2p_bwd_finish(qd, kd, v, g, beta, gc, w, u, tinv, do, h_in, held, dh_out, scale,
                                 qk_grad_dtype=q.dtype if q.dtype == k.dtype else None)
