"""`train.sdpa_backend`: the one PyTorch SDPA kernel the model's own attention calls run on.

With the setting, the model's own SDPA calls run as transformers wrote them, at cp 1 too (where,
unset, the CP regions' local kernels run the attention: adapters/hf_attention.py). Left to itself,
PyTorch picks cuDNN's kernel on an H200 (torch 2.11) for the 0.57B benchmark model's heads (8 query,
2 KV, dim 256), read from the profiler in the trainer's step
(benchmarks/results/trainer_profile_2026-12-03_NVIDIA-H200.md). The setting pins a kernel, for a
comparison or where PyTorch's pick differs. The rewritten CP regions choose their own kernels
(`kernels/attention`) and do not read this.

The setting makes the named backend the only one SDPA may use for the step's forward and backward
(the checkpoint replays run in the backward, and must choose as the forward did: a replay that
picked another kernel would save other tensors). A call that kernel refuses (a shape, a dtype, a
mask it does not take) fails with PyTorch's reason rather than running on another kernel unasked;
unset the setting to let PyTorch choose again. Only one backend, not a priority order: PyTorch's
CPU dispatch reads which backends are enabled, not their order.
"""
from __future__ import annotations

import contextlib
from typing import Literal

from torch.nn.attention import SDPBackend, sdpa_kernel

# train.sdpa_backend's names (the config's type) -> (the backend, the devices its kernel runs on)
SDPABackendName = Literal["cudnn", "flash", "efficient", "math"]
SDPA_BACKENDS: dict[str, tuple[SDPBackend, tuple[str, ...]]] = {
    "cudnn": (SDPBackend.CUDNN_ATTENTION, ("cuda",)),
    "flash": (SDPBackend.FLASH_ATTENTION, ("cuda", "cpu")),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, ("cuda",)),
    "math": (SDPBackend.MATH, ("cuda", "cpu", "npu")),
}


def only_sdpa_backend(name: str | None) -> contextlib.AbstractContextManager:
    """A context in which SDPA runs on `name`'s kernel alone; PyTorch's choice when `name` is None."""
    if name is None:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPA_BACKENDS[name][0]])
