"""Affine state summaries of Gated DeltaNet segments, and their algebra.

A GDN segment (a chunk, a rank's local slice, a whole sequence) acts on the recurrent state
``H [B, Hv, K, V]`` as an affine map::

    H_out = M @ H_in + S        M [B, Hv, K, K],  S [B, Hv, K, V]

``M`` is the product of the per-token transitions ``exp(g_t) (I - beta_t k_t k_t^T)`` (later tokens
on the left) and ``S`` is the state the segment produces from ``H_in = 0``. Everything here is pure
linear algebra on such pairs; how a pair is computed from tokens lives in ``gdn_eager``.

Order matters everywhere: summaries compose like matrices, so "earlier, later" is not the same as
"later, earlier". Lists are always in sequence (= CP rank) order, earliest first.

The backward of ``H_out = M @ H_in + S`` w.r.t. ``H_in`` is ``M^T @ dH_out``; a segment's own
outputs add a "local" term that does not depend on ``H_in`` (the outputs are affine in it), so the
state gradient flows from the last rank to the first as ``dH_in = local + M^T @ dH_out``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Summary = tuple[Tensor, Tensor]  # (M [B, Hv, K, K], S [B, Hv, K, V])


def apply_summary(M: Tensor, S: Tensor, h_in: Tensor | None = None) -> Tensor:
    """``M @ h_in + S``: the state after a segment entered with ``h_in`` (``None`` means zero)."""
    if h_in is None:
        return S
    return M @ h_in.to(M.dtype) + S


def summary_adjoint(M: Tensor, d_h_out: Tensor) -> Tensor:
    """``M^T @ d_h_out``: the part of ``dH_in`` that flows through the segment from ``dH_out``."""
    return M.transpose(-1, -2) @ d_h_out.to(M.dtype)


def combine_summaries(earlier: Summary, later: Summary) -> Summary:
    """Summary of ``earlier`` followed by ``later``: ``(M2 M1, M2 S1 + S2)``.

    Associative but not commutative; the argument order is the sequence order.
    """
    m_first, s_first = earlier
    m_next, s_next = later
    return m_next @ m_first, m_next @ s_first + s_next


def compose_summaries(summaries: Sequence[Summary], initial_state: Tensor | None = None) -> list[Tensor]:
    """Prefix states of a chain of segments given in rank (sequence) order.

    Returns ``P + 1`` states for ``P`` summaries: entry ``r`` is the state entering segment ``r``
    (entry 0 is ``initial_state``, zeros when ``None``) and entry ``P`` is the final state. This is
    the serial State-P2P chain written out on one process; State-AllGather computes the same
    prefixes after gathering every rank's pair.
    """
    if not summaries:
        raise ValueError("compose_summaries needs at least one (M, S) summary")
    first_s = summaries[0][1]
    state = torch.zeros_like(first_s) if initial_state is None else initial_state.to(first_s.dtype)
    states = [state]
    for m, s in summaries:
        state = apply_summary(m, s, state)
        states.append(state)
    return states


def chain_state_grads(
    local_grads: Sequence[Tensor], summaries: Sequence[Summary], d_final_state: Tensor | None = None
) -> list[Tensor]:
    """Reverse state-gradient chain ``dH_r = local_r + M_r^T dH_{r+1}``, segments in rank order.

    ``local_grads[r]`` is the gradient of the loss w.r.t. the state entering segment ``r`` through
    that segment's own outputs only (see ``gdn_eager.gdn_local_state_grad``). Returns ``P + 1``
    gradients aligned with ``compose_summaries``: entry ``r`` is ``dL/dH`` entering segment ``r``
    (entry 0 is the initial-state gradient), entry ``P`` is ``d_final_state`` (zeros when ``None``).
    """
    if len(local_grads) != len(summaries) or not summaries:
        raise ValueError(
            f"chain_state_grads needs one local gradient per summary, got {len(local_grads)} "
            f"local gradients for {len(summaries)} summaries"
        )
    grad = torch.zeros_like(local_grads[-1]) if d_final_state is None else d_final_state.to(local_grads[-1].dtype)
    grads = [grad]
    for local, (m, _) in zip(reversed(local_grads), reversed(summaries)):
        grad = local + summary_adjoint(m, grad)
        grads.append(grad)
    grads.reverse()
    return grads


def reduce_summaries_over_chunks(M: Tensor, S: Tensor) -> Summary:
    """Combine per-chunk summaries stacked on dim 2 (``[B, Hv, N, ...]``) into one, in order.

    A pairwise tree instead of a left-to-right loop: the same number of matmuls, but each level is
    one batched matmul over all pairs, so the depth is ``log2(N)`` rather than ``N``.
    """
    while M.shape[2] > 1:
        n_pairs = M.shape[2] // 2
        even = 2 * n_pairs
        m_next, s_next = combine_summaries(
            (M[:, :, 0:even:2], S[:, :, 0:even:2]), (M[:, :, 1:even:2], S[:, :, 1:even:2])
        )
        if M.shape[2] > even:  # odd count: the last chunk waits for the next level, order kept
            m_next = torch.cat([m_next, M[:, :, even:]], dim=2)
            s_next = torch.cat([s_next, S[:, :, even:]], dim=2)
        M, S = m_next, s_next
    return M[:, :, 0], S[:, :, 0]
