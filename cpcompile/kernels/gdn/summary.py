"""Affine state summaries of Gated DeltaNet segments, and their algebra — the one home of it.

A GDN segment (a chunk, a rank's local slice, a whole sequence) acts on the recurrent state
``H [B, Hv, K, V]`` as an affine map::

    H_out = M @ H_in + S        M [B, Hv, K, K],  S [B, Hv, K, V]

``M`` is the product of the per-token transitions ``exp(g_t) (I - beta_t k_t k_t^T)`` (later tokens
on the left) and ``S`` is the state the segment produces from ``H_in = 0``. Everything here is pure
linear algebra on such pairs; how a pair is computed from tokens lives in ``eager`` (and, for the
``triton`` backend, in the State-P2P summary kernels of ``triton.launch``).

Order matters everywhere: summaries compose like matrices, so "earlier, later" is not the same as
"later, earlier". Lists are always in sequence (= CP rank) order, earliest first.

The backward of ``H_out = M @ H_in + S`` w.r.t. ``H_in`` is ``M^T @ dH_out``; a segment's own
outputs add a "local" term that does not depend on ``H_in`` (the outputs are affine in it), so the
state gradient flows from the last rank to the first as ``dH_in = local + M^T @ dH_out``.
``chain_step`` / ``chain_grad_step`` are those two steps in fp32, as a State-P2P rank runs them
between receiving and sending.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..precision import without_autocast

Summary = tuple[Tensor, Tensor]  # (M [B, Hv, K, K], S [B, Hv, K, V])


def apply_summary(M: Tensor, S: Tensor, h_in: Tensor | None = None) -> Tensor:
    """``M @ h_in + S``: the state after a segment entered with ``h_in`` (``None`` means zero)."""
    if h_in is None:
        return S
    return M @ h_in.to(M.dtype) + S


@without_autocast
def state_step(M: Tensor, S: Tensor, h_in: Tensor) -> Tensor:
    """``M @ h_in + S`` at the summary's own precision (fp32) whatever the ambient autocast, which
    would round the matmul to bf16: one step of the eager State-P2P chain, a node of its graph."""
    return apply_summary(M, S, h_in)


def summary_adjoint(M: Tensor, d_h_out: Tensor) -> Tensor:
    """``M^T @ d_h_out``: the part of ``dH_in`` that flows through the segment from ``dH_out``."""
    return M.transpose(-1, -2) @ d_h_out.to(M.dtype)


def chain_step(M: Tensor, S: Tensor, h_in: Tensor | None) -> Tensor:
    """Forward step of the State-P2P chain in fp32: ``H_out = M @ H_in + S`` (``None``: zero state)."""
    return S.float().clone() if h_in is None else apply_summary(M.float(), S.float(), h_in.float())


def chain_grad_step(M: Tensor, dh_local: Tensor, dh_out: Tensor | None) -> Tensor:
    """Backward step in fp32: ``dH_in = dH_local + M^T @ dH_out`` (``dH_out = None`` means zero)."""
    if dh_out is None:
        return dh_local.float().clone()
    return dh_local.float() + summary_adjoint(M.float(), dh_out.float())


def combine_summaries(earlier: Summary, later: Summary) -> Summary:
    """Summary of ``earlier`` followed by ``later``: ``(M2 M1, M2 S1 + S2)``.

    Associative but not commutative; the argument order is the sequence order.
    """
    m_first, s_first = earlier
    m_next, s_next = later
    return m_next @ m_first, m_next @ s_first + s_next


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
