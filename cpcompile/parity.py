"""How a CP run in low precision is judged: against an fp32 run of the same model, next to the
single-device run in the same low precision.

bf16 alone moves logits and gradients by ~1e-2 relative, so "CP equals the bf16 single-device
run" cannot be told apart from noise with a fixed bound. Both runs are compared with an fp32 run
instead: CP passes when its error is at most `FACTOR` times the single-device error, plus `FLOOR`
for quantities that bf16 happens to get almost exactly right. In fp32 or float64 the plain
tolerances of the tests apply.
"""
from __future__ import annotations

import torch

FACTOR = 1.5
FLOOR = 1e-3


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def within_precision(cp_error: float, single_device_error: float, *, factor: float = FACTOR,
                     floor: float = FLOOR) -> bool:
    """True when CP's error against fp32 is within `factor` × the single-device error + `floor`."""
    return cp_error <= factor * single_device_error + floor
