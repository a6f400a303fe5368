"""Pure-PyTorch (eager) reference backend for the Gated DeltaNet (GDN) core used by Qwen3.5: the
chunkwise form, segment summaries and the local state gradient. The token recurrence it is checked
against is ``naive.py``; the input checks and layout both share, ``inputs.py``.

Conventions (those of transformers' ``torch_chunk_gated_delta_rule`` for Qwen3.5):

- ``q, k [B, T, Hk, K]``, ``v [B, T, Hv, V]``, ``g, beta [B, T, Hv]``; ``g`` is a log-space decay
  (``<= 0``), ``beta`` a write strength in ``(0, 1)``.
- Grouped value heads: ``Hv`` is a multiple of ``Hk`` and value head ``h`` reads key/query head
  ``h // (Hv // Hk)`` (transformers' ``repeat_interleave`` on the head dim, not ``repeat``).
- ``use_qk_l2norm_in_kernel`` normalises q and k as ``x * rsqrt(sum(x^2) + 1e-6)`` in the compute
  dtype; ``scale`` (default ``K ** -0.5``) multiplies q afterwards.
- State ``H [B, Hv, K, V]``. Per token::

      H   <- exp(g_t) H
      u_t  = beta_t (v_t - H^T k_t)          # delta rule: write only what H does not predict
      H   <- H + k_t u_t^T
      o_t  = H^T (scale q_t)

- Math runs in fp32 (float64 when an input is float64, so tests can be tight); ``o`` comes back in
  q's dtype, the final state in the compute dtype.

Chunkwise (WY / UT-transform) form, per chunk of ``C`` tokens entered with state ``H0``, with
``gamma`` the inclusive cumulative sum of ``g`` inside the chunk and ``D_ij = exp(gamma_i - gamma_j)``:

    A  = strictly_lower(beta_i k_i.k_j D_ij),  T = (I + A)^-1
    U  = T (beta v)                  # the chunk's updates if H0 were zero
    W  = T (beta exp(gamma) k)       # how much each update subtracts per unit of H0
    u  = U - W H0                    # the true per-token updates
    o  = exp(gamma) q H0 + lower_incl(q k^T * D) u
    H1 = M_c H0 + S_c,  M_c = exp(gamma_C) I - k~^T W,  S_c = k~^T U,  k~_t = exp(gamma_C - gamma_t) k_t

So every chunk's ``(M_c, S_c)`` summary is computed in parallel; the only serial part is the tiny
chain ``H_{c+1} = M_c H_c + S_c``, after which all outputs are again one batched computation. The
same per-chunk summaries, tree-reduced, give a segment's ``(M, S)`` for State-P2P / AllGather CP.
The affine algebra on summaries lives in ``summary``.

Packed documents (``starts [B, T]``, the first token of each): a start resets the state, so every
decay that crosses one is 0 — inside a chunk the decay sums restart at each start, the decay
matrix, ``exp(gamma)`` and ``exp(gamma_C - gamma_t)`` are masked across starts, and a chunk (or a
segment) holding a start has ``M = 0``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import CPInputError
from .common import CHUNK_SIZE
from .inputs import check_inputs, check_starts, compute_dtype, head_major, starting_state
from .summary import apply_summary, reduce_summaries_over_chunks, summary_adjoint

__all__ = ["chunk_gated_delta_rule_eager", "gdn_local_state_grad", "gdn_segment_summary"]

# ----------------------------------------------------------------------------- chunkwise pieces


def _to_chunks(x: Tensor, chunk_size: int) -> Tensor:
    """``[B, H, T, ...] -> [B, H, N, C, ...]``, zero-padding T up to a multiple of C.

    Zero padding is exact: a padded token has ``g = 0`` (no decay), ``beta = 0`` and ``k = 0``, so
    its transition is the identity and it writes nothing; padded outputs are sliced off.
    """
    seq_len = x.shape[2]
    pad = (-seq_len) % chunk_size
    trailing = x.dim() - 3  # feature dims after T
    if pad:
        x = F.pad(x, (0, 0) * trailing + (0, pad))
    return x.reshape(*x.shape[:2], -1, chunk_size, *x.shape[3:])


def _segments(starts: Tensor | None, chunk_size: int) -> Tensor | None:
    """``[B, 1, N, C]``: how many documents started in the chunk up to each token (inclusive);
    0 where the token still sees the state the chunk was entered with. None: one document."""
    if starts is None:
        return None
    return _to_chunks(starts[:, None].long(), chunk_size).cumsum(dim=-1)


def _decay_matrix(gamma: Tensor, segments: Tensor | None, *, include_diagonal: bool) -> Tensor:
    """``exp(gamma_i - gamma_j)`` on the causal (lower) triangle, 0 above it and between tokens of
    different documents (a document start resets the state: nothing decays across it).

    Masking happens before ``exp`` so the (positive) upper-triangle exponents never overflow.
    """
    chunk = gamma.shape[-1]
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=gamma.device).triu(1 if include_diagonal else 0)
    if segments is not None:
        above = above | (segments[..., :, None] != segments[..., None, :])
    diff = gamma[..., :, None] - gamma[..., None, :]
    return diff.masked_fill(above, float("-inf")).exp()


def _cumsum_within_documents(g: Tensor, segments: Tensor) -> Tensor:
    """Inclusive cumsum of g inside each chunk restarting at every document start, as one masked
    ``[C, C]`` product per chunk: another document's decay is multiplied by 0, not added and
    subtracted again, so its value cannot reach this document's rounding either."""
    chunk = g.shape[-1]
    upto = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril()
    same = upto & (segments[..., :, None] == segments[..., None, :])
    return (same.to(g.dtype) @ g[..., None]).squeeze(-1)


def _masked_exp(exponent: Tensor, keep: Tensor | None) -> Tensor:
    """``exp(exponent)``, 0 where not ``keep`` (masked before ``exp``: no inf, no NaN gradient)."""
    return exponent.exp() if keep is None else exponent.masked_fill(~keep, float("-inf")).exp()


def _from_chunk_start(gamma: Tensor, segments: Tensor | None) -> Tensor:
    """``exp(gamma_t)``: how much of the chunk's entering state token t still sees (0 from a
    document start on)."""
    return _masked_exp(gamma, None if segments is None else segments == 0)


class _ChunkWY(NamedTuple):
    """Intra-chunk quantities that do not depend on the chunk's entering state."""

    gamma: Tensor  # [B, H, N, C] inclusive cumsum of g inside each chunk (and document)
    updates: Tensor | None  # U = T (beta v)              [B, H, N, C, V]
    state_readers: Tensor  # W = T (beta exp(gamma) k)   [B, H, N, C, K]
    segments: Tensor | None  # `_segments`, or None for one document


def _chunk_wy(k: Tensor, v: Tensor | None, g: Tensor, beta: Tensor, segments: Tensor | None = None) -> _ChunkWY:
    """UT transform of every chunk at once (chunked ``[B, H, N, C, ...]`` inputs).

    One triangular solve per chunk replaces C sequential rank-1 delta updates; U and W share the
    solve by stacking their right-hand sides.
    """
    gamma = g.cumsum(dim=-1) if segments is None else _cumsum_within_documents(g, segments)
    system = (k @ k.transpose(-1, -2)) * beta[..., None] * _decay_matrix(gamma, segments, include_diagonal=False)
    k_rhs = k * (beta * _from_chunk_start(gamma, segments))[..., None]
    rhs = k_rhs if v is None else torch.cat([v * beta[..., None], k_rhs], dim=-1)
    # unitriangular=True: the system is I + strictly-lower A; the zero diagonal we pass is ignored.
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    if v is None:
        return _ChunkWY(gamma, None, solved, segments)
    value_dim = v.shape[-1]
    return _ChunkWY(gamma, solved[..., :value_dim], solved[..., value_dim:], segments)


def _keys_to_chunk_end(k: Tensor, wy: _ChunkWY) -> Tensor:
    """``k_t * exp(gamma_C - gamma_t)``: each key as still visible in the state at the chunk's end
    (0 for a key of a document that ended inside the chunk)."""
    gamma, segments = wy.gamma, wy.segments
    same_as_end = None if segments is None else segments == segments[..., -1:]
    return k * _masked_exp(gamma[..., -1:] - gamma, same_as_end)[..., None]


def _chunk_transition(k: Tensor, wy: _ChunkWY) -> Tensor:
    """``M_c = exp(gamma_C) I - k~^T W`` for every chunk: ``[B, H, N, K, K]`` (0 for a chunk
    holding a document start: the state after it does not depend on the state before)."""
    key_dim = k.shape[-1]
    eye = torch.eye(key_dim, dtype=k.dtype, device=k.device)
    decayed_keys = _keys_to_chunk_end(k, wy)
    end_decay = _from_chunk_start(wy.gamma[..., -1], None if wy.segments is None else wy.segments[..., -1])
    return end_decay[..., None, None] * eye - decayed_keys.transpose(-1, -2) @ wy.state_readers


def _chunk_summaries(k: Tensor, wy: _ChunkWY) -> tuple[Tensor, Tensor]:
    """Per-chunk ``(M_c [B,H,N,K,K], S_c [B,H,N,K,V])``, all chunks in parallel."""
    decayed_keys = _keys_to_chunk_end(k, wy)
    return _chunk_transition(k, wy), decayed_keys.transpose(-1, -2) @ wy.updates


def _scan_chunk_states(M: Tensor, S: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The one serial loop: states entering each chunk ``[B, H, N, K, V]``, and the final state."""
    entering = []
    for c in range(M.shape[2]):
        entering.append(state)
        state = apply_summary(M[:, :, c], S[:, :, c], state)
    return torch.stack(entering, dim=2), state


def _output_state_readout(q: Tensor, wy: _ChunkWY, intra: Tensor) -> Tensor:
    """``exp(gamma) q - intra @ W``: how each output reads the chunk's entering state ``[.., C, K]``."""
    return q * _from_chunk_start(wy.gamma, wy.segments)[..., None] - intra @ wy.state_readers


def _intra_chunk_scores(q: Tensor, k: Tensor, wy: _ChunkWY) -> Tensor:
    """Causal, decayed ``q k^T`` inside each chunk (diagonal included: o_t sees its own update),
    within documents."""
    return (q @ k.transpose(-1, -2)) * _decay_matrix(wy.gamma, wy.segments, include_diagonal=True)


# ----------------------------------------------------------------------------- public chunkwise API


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise CPInputError(f"chunk_size must be a positive int; got {chunk_size!r}")


def chunk_gated_delta_rule_eager(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = CHUNK_SIZE,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    starts: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise GDN, equal to ``naive_recurrent_gated_delta_rule``; differentiable by autograd.

    Any ``chunk_size`` and any ``T`` (padded internally, exactly). Returns ``(o [B,T,Hv,V] in q's
    dtype, final state [B,Hv,K,V] in the compute dtype or None)``. ``starts [B, T]`` (bool) marks
    packed documents' first tokens, where the state resets (None: one document, the plain path).
    """
    check_inputs(q, k, v, g, beta, initial_state)
    check_starts(starts, g)
    _check_chunk_size(chunk_size)
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    x = head_major(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, dtype=dtype)
    seq_len, value_dim = x.k.shape[2], x.v.shape[-1]
    state = starting_state(initial_state, x.k, value_dim)
    if seq_len == 0:
        return v.new_zeros(v.shape, dtype=q.dtype), (state if output_final_state else None)

    qc, kc, vc = (_to_chunks(t, chunk_size) for t in (x.q, x.k, x.v))
    gc, bc = _to_chunks(x.g, chunk_size), _to_chunks(x.beta, chunk_size)
    wy = _chunk_wy(kc, vc, gc, bc, _segments(starts, chunk_size))
    entering, final_state = _scan_chunk_states(*_chunk_summaries(kc, wy), state)

    intra = _intra_chunk_scores(qc, kc, wy)
    out = _output_state_readout(qc, wy, intra) @ entering + intra @ wy.updates
    out = out.reshape(*out.shape[:2], -1, value_dim)[:, :, :seq_len]
    return out.transpose(1, 2).to(q.dtype), (final_state if output_final_state else None)


def gdn_segment_summary(
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = CHUNK_SIZE,
    use_qk_l2norm_in_kernel: bool = False,
    starts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(M [B,Hv,K,K], S [B,Hv,K,V])`` of a whole segment, in the compute dtype (fp32/float64).

    ``H_out = M @ H_in + S`` for any ``H_in``. Built from per-chunk summaries (computed in parallel)
    combined by a pairwise tree, never from T per-token K x K products. Needs no q: the state does
    not depend on queries. With a document start in the segment (``starts [B, T]``), M is 0 and S
    is the state after the last start: the entering state reaches nothing beyond it.
    """
    check_inputs(None, k, v, g, beta, None)
    check_starts(starts, g)
    _check_chunk_size(chunk_size)
    dtype = compute_dtype(k, v, g, beta)
    x = head_major(None, k, v, g, beta, scale=None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, dtype=dtype)
    batch, heads, seq_len, key_dim = x.k.shape
    if seq_len == 0:
        eye = torch.eye(key_dim, dtype=dtype, device=k.device).expand(batch, heads, key_dim, key_dim)
        return eye.clone(), x.k.new_zeros(batch, heads, key_dim, x.v.shape[-1])
    kc = _to_chunks(x.k, chunk_size)
    wy = _chunk_wy(kc, _to_chunks(x.v, chunk_size), _to_chunks(x.g, chunk_size), _to_chunks(x.beta, chunk_size),
                   _segments(starts, chunk_size))
    return reduce_summaries_over_chunks(*_chunk_summaries(kc, wy))


def gdn_local_state_grad(
    q: Tensor,
    k: Tensor,
    g: Tensor,
    beta: Tensor,
    d_o: Tensor,
    *,
    chunk_size: int = CHUNK_SIZE,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> Tensor:
    """Gradient w.r.t. the segment's entering state through its own outputs only: ``[B,Hv,K,V]``.

    The outputs are affine in the entering state, so this term needs neither v nor the state
    itself; a State-P2P rank can compute it before ``dH_out`` arrives and then send
    ``dH_in = local + M^T dH_out`` at once. Per chunk the readout is ``R_c = exp(gamma) q - intra W``,
    and the chunk chain runs backwards: ``d_c = R_c^T dO_c + M_c^T d_{c+1}``.
    """
    if d_o.dim() != 4 or tuple(d_o.shape[:3]) != tuple(g.shape):
        raise CPInputError(f"d_o must be [B, T, Hv, V] matching g {tuple(g.shape)}; got {tuple(d_o.shape)}")
    check_inputs(q, k, d_o, g, beta, None)
    _check_chunk_size(chunk_size)
    dtype = compute_dtype(q, k, g, beta, d_o)
    x = head_major(q, k, d_o, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, dtype=dtype)
    batch, heads, seq_len, key_dim = x.k.shape
    grad = x.k.new_zeros(batch, heads, key_dim, x.v.shape[-1])  # nothing flows in from dH_out here
    if seq_len == 0:
        return grad
    qc, kc, d_oc = (_to_chunks(t, chunk_size) for t in (x.q, x.k, x.v))
    wy = _chunk_wy(kc, None, _to_chunks(x.g, chunk_size), _to_chunks(x.beta, chunk_size))
    readout = _output_state_readout(qc, wy, _intra_chunk_scores(qc, kc, wy))
    local = readout.transpose(-1, -2) @ d_oc  # [B, H, N, K, V]: each chunk's own output term
    transition = _chunk_transition(kc, wy)
    for c in reversed(range(transition.shape[2])):
        grad = local[:, :, c] + summary_adjoint(transition[:, :, c], grad)
    return grad
