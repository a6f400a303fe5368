"""The kernels `masked_attention.py` times, each `(q, k, v, key_tags, chunk_starts) -> out` on
`q [1, Hq, S_q, D]` and `k, v [1, Hkv, S_kv, D]` (views of `[1, S, H, D]`), causal, scale D^-0.5; and how
cu_seq_q / cu_seq_k come from key tags (`segments`).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpcompile.kernels.attention import local_attention  # noqa: E402
from cpcompile.kernels.attention.flex import block_mask  # noqa: E402
from cpcompile.kernels.attention.op import chunk_attention  # noqa: E402

aten = torch.ops.aten
# torch's H100 FlexAttention defaults (template_heuristics/triton.py, 2.13), fwd (M, N, stages, warps) and bwd
# (M1, N1, M2, N2, stages, warps): D=256 (64, 32, 3, 4), (64, 64, 64, 64, 2, 4); D=128 (128, 64, 3, 8),
# (64, 128, 128, 64, 3, 8). The settings below try others; blocks must divide the block mask's 128.


def _fwd(m: int, n: int, stages: int, warps: int) -> dict:
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_stages": stages, "fwd_num_warps": warps}


def _bwd(m1: int, n1: int, m2: int, n2: int, stages: int, warps: int) -> dict:
    return {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_stages": stages, "bwd_num_warps": warps}


FLEX_OPTIONS = {  # name: kernel_options; the name gives (M, N, stages, warps) and (M1/N1, stages, warps)
    256: {"fwd 128x64 s2 w8, bwd 32/64 s2 w4": {**_fwd(128, 64, 2, 8), **_bwd(32, 64, 64, 32, 2, 4)},
          "fwd 64x64 s2 w4, bwd 64/64 s1 w8": {**_fwd(64, 64, 2, 4), **_bwd(64, 64, 64, 64, 1, 8)}},
    128: {"fwd 128x128 s2 w8, bwd 32/64 s3 w4": {**_fwd(128, 128, 2, 8), **_bwd(32, 64, 64, 32, 3, 4)},
          "fwd 128x64 s3 w8, bwd 64/128 s2 w8": {**_fwd(128, 64, 3, 8), **_bwd(64, 128, 128, 64, 2, 8)}},
}


def tag_runs(tags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Starts and ends of the runs of equal tags of one row `[S]`: a document's real keys, or a padding run."""
    change = torch.nonzero(tags[1:] != tags[:-1]).flatten() + 1
    bounds = torch.cat([change.new_zeros(1), change, change.new_full((1,), tags.numel())])
    return bounds[:-1], bounds[1:]


def unmasked(kernel: str):  # the reference: cpcompile's unmasked blocks
    return lambda q, k, v, tags, starts: chunk_attention(q, k, v, starts, True, q.shape[-1] ** -0.5, kernel)[0]


def cpcompile_masked(masked_kernel: str):
    """cpcompile's masked path on `masked_kernel` (`varlen`: the default on CUDA in bf16 since 2026-12-06)."""
    def run(q, k, v, tags, starts):
        return local_attention(q, k, v, tags, starts, True, q.shape[-1] ** -0.5, "flash", masked_kernel, None, False)
    return run


_FLEX = {}


def flex_with(options: dict):
    """FlexAttention under cpcompile's block mask with these kernel_options (one compiled callable each)."""
    def run(q, k, v, tags, starts):
        from torch.nn.attention.flex_attention import flex_attention

        fn = _FLEX.setdefault("compiled", torch.compile(flex_attention, dynamic=False))
        mask = block_mask(tags, starts, q.shape[2], True)
        return fn(q, k, v, block_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != k.shape[1],
                  kernel_options=dict(options))
    return run


def segments(tags: torch.Tensor, start: int, length: int):
    """cu_seq_q / cu_seq_k (int32) of one chunk of queries `[start, start+length)` against keys `[0, end)`:
    one segment per run of equal tags that holds queries; its keys are the run up to the chunk end
    (causal attention aligned bottom-right, as flash does for L_q < L_k). Runs before the chunk are
    skipped, so cu_seq_k may start above 0. Also the exact max_q, max_k (a host sync)."""
    end = start + length
    run_start, run_end = tag_runs(tags[0, :end])
    keep = run_end > start
    run_start, run_end = run_start[keep], run_end[keep]
    q_bounds = torch.cat([run_start.clamp(min=start)[:1], run_end]) - start
    k_bounds = torch.cat([run_start[:1], run_end])
    max_q = int((run_end - run_start.clamp(min=start)).max())
    max_k = int((run_end - run_start).max())
    return q_bounds.int(), k_bounds.int(), max_q, max_k


def _varlen_api():
    name = "torch.nn.attention.varlen"
    return getattr(importlib.import_module(name), "varlen_attn", None) if importlib.util.find_spec(name) else None


def _varlen_kwargs(params, q_heads: int, k, v):
    """Causality and GQA spelled as this torch's varlen_attn takes them (2.13: window_size=(-1, 0) and
    enable_gqa; earlier: is_causal=, and K/V repeated to the query heads when enable_gqa is absent)."""
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q_heads != k.shape[1]
    elif q_heads != k.shape[1]:
        k, v = (x.repeat_interleave(q_heads // x.shape[1], dim=1) for x in (k, v))
    return kwargs, k, v


def varlen(exact_max: bool):
    def run(q, k, v, tags, starts):
        varlen_attn = _varlen_api()
        params = inspect.signature(varlen_attn).parameters
        (length, d), outs = q.shape[2:], []
        k3, v3 = (x.transpose(1, 2).reshape(-1, x.shape[1], d) for x in (k, v))  # [S, Hkv, D] views
        for i, start in enumerate(starts):
            c = length // len(starts)
            q3 = q[:, :, i * c:(i + 1) * c].transpose(1, 2).reshape(c, q.shape[1], d)
            cu_q, cu_k, max_q, max_k = segments(tags, start, c)
            if not exact_max:
                max_q, max_k = c, start + c
            kwargs, kk, vv = _varlen_kwargs(params, q.shape[1], k3, v3)
            outs.append(varlen_attn(q3, kk, vv, cu_q, cu_k, max_q, max_k, scale=d ** -0.5, **kwargs))
        return torch.cat(outs).reshape(1, length, q.shape[1], d).transpose(1, 2)
    return run


class _CudnnRagged(torch.autograd.Function):
    """cuDNN's ragged attention (cum_seq_q/cum_seq_k), forward and backward, on `[T, H, D]`."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k):
        res = aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, True, False,
                                            scale=q.shape[-1] ** -0.5)
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu_q, cu_k)
        ctx.max = (max_q, max_k)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seed, offset, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = aten._cudnn_attention_backward(grad.contiguous(), q, k, v, out, lse, seed, offset, None, cu_q,
                                                    cu_k, *ctx.max, 0.0, True, scale=q.shape[-1] ** -0.5)
        return dq, dk, dv, None, None, None, None


def cudnn_ragged(q, k, v, tags, starts):
    """cp 1 only (query and key segments equal; cuDNN's causal mask is top-left aligned)."""
    if starts != [0] or q.shape[2] != k.shape[2]:
        raise NotImplementedError("cuDNN ragged row runs the cp 1 layout only (top-left causal alignment)")
    (length, d), hq = q.shape[2:], q.shape[1]
    k, v = (x.repeat_interleave(hq // x.shape[1], dim=1) for x in (k, v))  # no GQA on this path
    q3, k3, v3 = (x.transpose(1, 2).reshape(length, hq, d) for x in (q, k, v))
    cu_q, cu_k, max_q, max_k = segments(tags, 0, length)
    out = _CudnnRagged.apply(q3, k3, v3, cu_q, cu_k, max_q, max_k)
    return out.reshape(1, length, hq, d).transpose(1, 2)


def dense_mask_sdpa(q, k, v, tags, starts):
    """What transformers does today: K/V repeated to the query heads and a dense [S_q, S_kv] bool mask."""
    length = q.shape[2]
    positions = torch.arange(length, device=q.device) + starts[0]
    docs = torch.where(tags >= 0, tags, -tags - 1)
    seen = (tags[:, None, :] == docs[:, positions][:, :, None]) & \
        (torch.arange(k.shape[2], device=q.device) <= positions[:, None])
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None])


def masked_kernels(head_dim: int, args, with_options: bool) -> dict:
    """Every masked kernel; the FlexAttention kernel_options rows only `with_options` (each (S, setting)
    is a compilation of its own, ~12 s on an H100: they run at one length, `--options-at`); cuDNN's
    ragged row only on request (on torch 2.11 / H100 its gradients were wrong as called here, and one
    call took 50-150 ms at S=1024)."""
    options = list(FLEX_OPTIONS[head_dim].items())[:1 if args.quick else None] if with_options else []
    kernels = {"local_attention masked (varlen, as shipped)": cpcompile_masked("varlen"),
               "local_attention masked (flex, shipped until 2026-12-06)": cpcompile_masked("flex")}
    kernels.update({f"flex {name}": flex_with(opts) for name, opts in options})
    if _varlen_api() is not None:
        kernels["varlen_attn, exact max_q/max_k"] = varlen(True)
        kernels["varlen_attn, max_q/max_k = chunk bounds"] = varlen(False)
    if args.cudnn_ragged:
        kernels["cudnn ragged (cum_seq)"] = cudnn_ragged
    return kernels
