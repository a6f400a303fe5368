"""The token recurrence of the Gated DeltaNet core: the oracle every other form (the eager
chunkwise form, the Triton kernels, each CP method) is checked against, as flash-linear-attention
keeps a ``naive`` beside each kernel. O(T) Python steps; conventions in ``eager``'s docstring.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .inputs import check_inputs, check_starts, compute_dtype, head_major, starting_state

__all__ = ["naive_recurrent_gated_delta_rule"]


def naive_recurrent_gated_delta_rule(
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
    starts: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token GDN: the oracle every other form is checked against. O(T) Python steps.

    ``starts [B, T]`` (bool, optional) marks packed documents' first tokens: the state is zeroed
    before such a token is read or written.
    """
    check_inputs(q, k, v, g, beta, initial_state)
    check_starts(starts, g)
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    x = head_major(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, dtype=dtype)
    state = starting_state(initial_state, x.k, x.v.shape[-1])
    outputs = []
    for t in range(x.k.shape[2]):
        k_t = x.k[:, :, t]
        if starts is not None:
            state = state * (~starts[:, t]).to(state.dtype)[:, None, None, None]
        state = state * x.g[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)  # what the decayed state recalls for k_t
        update = x.beta[:, :, t, None] * (x.v[:, :, t] - predicted)
        state = state + k_t[..., :, None] * update[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", x.q[:, :, t], state))
    out = torch.stack(outputs, dim=2) if outputs else x.v.new_zeros(x.v.shape)
    return out.transpose(1, 2).to(q.dtype), (state if output_final_state else None)
