"""The State-P2P / State-AllGather chains written out on one process, from segment summaries:
what the CP rewrites compute across ranks, as a reference the GDN kernel tests check against.
Test-only: the library runs these chains as collectives (passes/gdn) or inside the Triton executor."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cpcompile.kernels.gdn.summary import Summary, apply_summary, summary_adjoint


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
    that segment's own outputs only (see ``eager.gdn_local_state_grad``). Returns ``P + 1``
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
