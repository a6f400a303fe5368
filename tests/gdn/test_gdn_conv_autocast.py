"""`causal_conv` gives the dtype `F.conv1d` gives, under autocast too, on every path: traced by
Dynamo (conv taps, as compiled layers inline a CP region), packed documents (taps, eager) and the
plain conv. A Hugging Face Trainer with `bf16=True` runs the layers under autocast, and the region's
graph, traced there, asserts the conv's output is bfloat16: fp32 taps failed its compile."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpcompile.kernels.gdn.conv import causal_conv

CHANNELS, KERNEL, TOKENS = 6, 4, 11


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    history = torch.randn(1, CHANNELS, TOKENS + KERNEL - 1, generator=gen)
    weight = torch.randn(CHANNELS, 1, KERNEL, generator=gen)
    return history, weight


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("path", ["dynamo", "packed", "conv1d"])
def test_dtype_and_values_are_conv1ds(path, autocast):
    history, weight = _inputs(seed=len(path) + autocast)
    positions = torch.arange(TOKENS)[None] + KERNEL if path == "packed" else None  # one document: all taps read
    run = causal_conv
    if path == "dynamo":
        torch._dynamo.reset()
        run = torch.compile(causal_conv, backend="eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = F.conv1d(history, weight, None, groups=CHANNELS)
        got = run(history, weight, None, "eager", positions)
    assert want.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert got.dtype == want.dtype, (path, got.dtype)
    tolerance = 3e-2 if autocast else 1e-5  # bf16 conv against fp32 taps rounded once
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
