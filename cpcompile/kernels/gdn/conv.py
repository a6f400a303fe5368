"""The GDN layer's causal depthwise conv (Qwen3.5's `conv1d`, kernel K, one filter a channel), on
its input with the K − 1 tokens of left context already in front (`history [B, C, T + K − 1]`: zeros,
or under CP the previous rank's halo).

`causal_conv` is what the layer and the CP regions call: `F.conv1d` when run eagerly or traced by
`torch.export`, `conv_taps` when Dynamo traces it. `conv_taps` is also the packed-documents conv,
and `F.conv1d` its oracle (tests/gdn/test_gdn_adapter.py, tests/gdn/test_gdn_packed.py).

On the `triton` GDN backend, run eagerly on CUDA (`triton_conv_applies`), the conv is instead
`cpcompile::gdn_conv` (`conv_ops.py`, kernels in `triton/conv.py`): the layer's own call
(`conv_silu_tokens`) reads the projection's token-major output and writes the SiLU'd conv
token-major, so q, k and v are plain views of it; a CP region's `causal_conv` reads its `history`.
PyTorch's depthwise conv kernel was several times its memory time there (below), and the
`[B, C, T]` layout around it cost transposing copies in the layer and the core.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import conv_ops  # noqa: F401  (registers cpcompile::gdn_conv)


# The Triton conv is proven against its oracle on CPU, in Triton's interpreter, only: it has not
# run on a GPU yet. It stays off until a GPU run has checked and timed it (`pytest -m gpu
# tests/kernels/test_gdn_conv_triton.py`, `benchmarks/gdn_conv.py --tune`, then the benchmark);
# until then eager CUDA layers keep `F.conv1d` and `conv_taps`.
TRITON_CONV_ON_GPU = False


def triton_conv_applies(x: torch.Tensor, backend: str) -> bool:
    """The `triton` backend on CUDA, run eagerly: not under Dynamo (whose inductor fuses the taps)
    nor `torch.export` (a CP rewrite finds the conv's pad and `conv1d` or taps in the graph)."""
    return TRITON_CONV_ON_GPU and backend == "triton" and x.is_cuda and not torch.compiler.is_compiling()


def conv_silu_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     positions: torch.Tensor | None) -> torch.Tensor:
    """SiLU of the causal conv of `x [B, T, C]` (zeros as left context; `positions [B, T]`: within
    documents) -> `[B, T, C]` contiguous in x's dtype: one Triton kernel, fp32 inside. As the layer
    states it, x is cast to the weight's dtype first; to float32 the kernel's fp32 read is that
    cast (no fp32 copy), and its output is rounded to x's dtype once."""
    taps_input = x if weight.dtype == torch.float32 else x.to(weight.dtype)
    return torch.ops.cpcompile.gdn_conv(taps_input, weight, bias, positions, True, False).to(x.dtype)


def causal_conv(history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                backend: str = "eager", positions: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise conv of one document a row, or of packed documents with `positions`
    (`history`: the input with its left context).

    Under `torch.compile` (Dynamo tracing: the trainer's compiled layers, and the CP regions they
    inline, whose rewritten graphs call this function: `passes/gdn/conv_halo.py`) it is `conv_taps`' K
    shifted multiply-adds, which inductor fuses with the transposes, the pad, the SiLU and the
    casts around them into a few memory-bound kernels (and their backward, the weight's gradient
    included); `F.conv1d` would stay an opaque kernel there, and PyTorch's depthwise conv kernel on
    CUDA took 2.2 ms for a [32K, 6144] bfloat16 input on an H200, several times that input's memory
    time (benchmarks/results/trainer_profile_2026-12-03_NVIDIA-H200.md). Eagerly (a CP region's
    graph run eagerly included) and under `torch.export`, `F.conv1d`: one kernel, and autograd keeps
    only its input (the taps' would keep each tap's product). The taps sum in float32 at least, as
    the conv kernels accumulate (fused, the float copies are registers, not memory). On the
    `triton` backend run eagerly on CUDA, `cpcompile::gdn_conv` on the history read token-major
    (a transposed view, no copy), its output returned as a `[B, C, T]` view of token-major memory,
    so that the region's SiLU and transpose back keep that layout.

    With `positions [B, T]` (packed documents, a CP region's rewritten taps:
    `passes/gdn/conv_taps.py`) it is `conv_taps` with them, eagerly in the history's dtype as the
    layer traced it, or the Triton conv."""
    if torch.compiler.is_dynamo_compiling():
        wide = torch.promote_types(history.dtype, torch.float32)
        out = conv_taps(history.to(wide), weight.to(wide), None if bias is None else bias.to(wide), positions)
        return out.to(conv_output_dtype(history))
    if triton_conv_applies(history, backend):
        out = torch.ops.cpcompile.gdn_conv(history.transpose(1, 2), weight, bias, positions, False, True)
        return out.transpose(1, 2)
    if positions is not None:
        return conv_taps(history, weight, bias, positions).to(conv_output_dtype(history))
    return F.conv1d(history, weight, bias, groups=history.shape[1])


def conv_output_dtype(history: torch.Tensor) -> torch.dtype:
    """The dtype `F.conv1d` gives: autocast's where it is on (a Trainer's `bf16=True` runs the layers
    under autocast, and the graph the region traced there expects the conv's output in it), else
    the input's."""
    device = history.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else history.dtype


def conv_taps(history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise conv as K elementwise terms, linear in T; with `positions`, each output
    reads only tokens of its own document.

    `history [B, C, T + K - 1]` is the conv input with its K − 1 tokens of left context, `weight
    [C, 1, K]`, `positions [B, T]`. Output t reads the token j steps back (weight tap K − 1 − j);
    with `positions` only when `j <= positions[t]`: a token of another document is never read (not
    read and subtracted), so moving it changes nothing, bit for bit.
    """
    kernel, length = weight.shape[-1], history.shape[-1] - weight.shape[-1] + 1
    out = None
    for tap in range(kernel):
        back = kernel - 1 - tap
        tokens = history[..., tap:tap + length]
        if back and positions is not None:
            tokens = torch.where((positions >= back)[:, None], tokens, 0.0)
        term = tokens * weight[:, 0, tap, None]
        out = term if out is None else out + term
    return out if bias is None else out + bias[:, None]
