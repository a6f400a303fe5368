"""The oracle beside the attention kernels: explicit-mask attention in float64 (tests only, small S)."""
from __future__ import annotations

import torch
from torch import Tensor

from .layout import query_documents, visible
from .layout import query_positions as query_positions_of


def naive_attention(q: Tensor, k: Tensor, v: Tensor, chunk_starts: list[int], *, causal: bool = True,
                    key_tags: Tensor | None = None, scale: float | None = None,
                    query_positions: Tensor | None = None) -> Tensor:
    """Softmax attention with the visibility the kernels implement; rows that see nothing give 0."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    tags = key_tags if key_tags is not None else torch.zeros(k.shape[0], k.shape[2], dtype=torch.long)
    tags = tags.to(q.device)
    positions = (query_positions.to(q.device) if query_positions is not None
                 else query_positions_of(chunk_starts, q.shape[2], q.device))
    seen = visible(tags, query_documents(tags, positions), positions, k.shape[2], causal)[:, None]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs @ v


def _segments(cu_q: Tensor, cu_k: Tensor):
    return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())


def _segment_probs(q: Tensor, k: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax and log-sum-exp of one segment (`[H, L_q, D]` against `[H, L_k, D]`, float64), a
    causal one aligned at its end: query r of L_q sees key j of L_k when j ≤ r + L_k − L_q."""
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        rows = torch.arange(q.shape[1])[:, None] + k.shape[1] - q.shape[1]
        scores = scores.masked_fill(torch.arange(k.shape[1]) > rows, float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp().nan_to_num(0.0), lse


def _heads_first(x: Tensor, lo: int, hi: int, groups: int = 1) -> Tensor:
    return x[lo:hi].double().transpose(0, 1).repeat_interleave(groups, 0)


def naive_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, causal: bool,
                 scale: float) -> tuple[Tensor, Tensor]:
    """What flash's variable-length kernel computes on `[T, H, D]` tensors, in float64: segment i's
    queries `cu_q[i]:cu_q[i+1]` attend to its keys `cu_k[i]:cu_k[i+1]`; a query with no key gets 0
    and log-sum-exp +inf. Returns (out in q's dtype, lse fp32 `[Hq, T_q]`)."""
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64)
    for q0, q1, k0, k1 in _segments(cu_q, cu_k):
        if q1 > q0 and k1 > k0:
            probs, lse[:, q0:q1] = _segment_probs(_heads_first(q, q0, q1), _heads_first(k, k0, k1, groups), causal,
                                                  scale)
            out[q0:q1] = (probs @ _heads_first(v, k0, k1, groups)).transpose(0, 1)
    return out.to(q.dtype), lse.float()


def naive_varlen_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
                          causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of `naive_varlen` (in the inputs' dtypes): a key no query of its segment reads
    gets 0, grouped query heads' key gradients summed onto their K/V head."""
    groups = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros((k.shape[0], q.shape[1], k.shape[2]), dtype=torch.float64)
    dv = torch.zeros_like(dk)
    for q0, q1, k0, k1 in _segments(cu_q, cu_k):
        if q1 == q0 or k1 == k0:
            continue
        qs, ks, vs = _heads_first(q, q0, q1), _heads_first(k, k0, k1, groups), _heads_first(v, k0, k1, groups)
        g = _heads_first(grad_out, q0, q1)
        probs, _ = _segment_probs(qs, ks, causal, scale)
        d_probs = g @ vs.transpose(-1, -2)
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * scale
        dq[q0:q1] = (d_scores @ ks).transpose(0, 1)
        dk[k0:k1] = (d_scores.transpose(-1, -2) @ qs).transpose(0, 1)
        dv[k0:k1] = (probs.transpose(-1, -2) @ g).transpose(0, 1)
    fold = lambda x: x.unflatten(1, (k.shape[1], groups)).sum(2)
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)
