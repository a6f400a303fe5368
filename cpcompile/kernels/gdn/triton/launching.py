"""How every GDN kernel is launched: the per-kernel launch table (``NUM_WARPS``, ``NUM_STAGES``,
``STATE_BV``, keyed by kernel; the ``--tune`` sweep of ``benchmarks/gdn_kernels.py`` walks it by
key), ``launch`` (a kernel at its tuned pipeline depth, or the deepest this GPU's shared memory
fits), the dot-precision flags and the shapes every launcher reads.

The stage files (``prepare``, ``state``, ``output``, ``p2p_summary``, ``p2p_output``, ``bwd_state``,
``bwd_inter``, ``bwd_prepare``, ``l2norm``) call ``launching.launch`` / ``launching.flags`` through
this module, so a benchmark or test that replaces one here (``FIT_STAGES``, ``flags``, ``launch``)
reaches every kernel.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor
from triton.runtime.errors import OutOfResources

from ....errors import GDNCapabilityError
from ..common import CHUNK_SIZE

# num_warps / num_stages per kernel; benchmarks may override. "bwd_state_aug" is State-P2P's augmented
# (K + V wide) reverse pass, "p2p_summary" / "p2p_chain" its forward summary. Tuned on an H200 at T=16K
# (`benchmarks/gdn_kernels.py --tune`, results/gdn_kernels_2026-12-01_NVIDIA-H200.md): the plain state pass
# 4 warps (0.565 ms, 8: 0.584), the prepare backward 4 (8 spilled: 1.395 vs 1.198), the plain output 4
# (0.234 ms, 2: 0.307, 8: 0.431; results/gdn_kernels_2026-12-01_NVIDIA-H200_output-warps.md). The augmented
# backward pass, since it keeps nothing per chunk, 4 (State-P2P's backward summary 0.758 / 2.911 ms at
# 16K / 64K, 8: 0.837 / 3.250; `--p2p-variants`, results/gdn_p2p_segments_2026-12-01_NVIDIA-H200.md). The
# forward summary 4 warps / value block 64 (0.438 ms at 16K; 8 warps 0.540, value block 32 0.472;
# results/gdn_p2p_split_summary_2026-12-01_NVIDIA-H200.md) / 4 stages: with the per-call group length
# (4 groups) 0.333 against 0.388 ms at 3 stages at 16K, 1.127 against 1.334 at 64K; 5 stages and an
# identity block of 128 were slower, 6 stages overflow the shared memory
# (results/gdn_p2p_summary_stages_2026-12-01_NVIDIA-H200.md). Its chain keeps a K x K fp32 tile, so one stage.
NUM_WARPS = {"prepare": 4, "state": 4, "p2p_summary": 4, "p2p_chain": 8, "output": 4, "p2p_output": 4,
             "dv_local": 2, "bwd_state": 4, "bwd_state_aug": 4, "inter": 8, "bwd_wy": 4}
NUM_STAGES = {"state": 3, "p2p_summary": 4, "p2p_chain": 1, "bwd_state": 3, "bwd_state_aug": 3, "inter": 3,
              "p2p_output": 1}


# value-column block of the chunk-sequential state passes (more blocks = more CTAs in flight);
# the augmented (K+V wide) backward pass already has twice the blocks, and the forward summary's value
# programs share the SMs with its identity programs. Tuned on an H200 at T=16K.
STATE_BV = {"state": 32, "p2p_summary": 64, "bwd_state": 32, "bwd_state_aug": 64}


def stages(name: str, dtype: torch.dtype) -> int:
    """Software-pipelining depth of a kernel's loop. fp32 tiles overflow Hopper's 227 KiB of shared
    memory when multi-buffered."""
    return 1 if dtype == torch.float32 else NUM_STAGES[name]


def state_bv(key: str, K: int, V: int) -> int:
    """The value-column block of a chunk-sequential state pass (``STATE_BV``), at most K and V."""
    return min(STATE_BV[key], K, V)


# (kernel, device, tuned stages, launch options) -> the deepest pipeline that fit that GPU's shared memory,
# only for launches that had to step down (empty on the GPU the depths were tuned on)
_FITTED_STAGES: dict[tuple, int] = {}
# False: a depth that does not fit raises instead (a tuning sweep must time the depth it names)
FIT_STAGES = True


def launch(kernel, grid, *args, **options) -> None:
    """``kernel[grid](*args, **options)`` at its tuned pipeline depth (``num_stages``, default Triton's
    3), or at the deepest that fits this GPU's shared memory. The depths are tuned on an H200 (227 KiB
    per SM); a GPU with less (an A100 has 163 KiB) could not build some of them. Stages only schedule
    the loop's loads, so every depth computes the same result: a step down warns once, as it is
    slower than tuned. A kernel that does not fit even unpipelined raises ``GDNCapabilityError``."""
    tuned = stages = options.pop("num_stages", 3)
    key = None
    if _FITTED_STAGES:  # the hot path builds no key until some launch has stepped down
        key = _fit_key(kernel, tuned, options)
        stages = _FITTED_STAGES.get(key, tuned)
    while True:
        try:
            kernel[grid](*args, num_stages=stages, **options)
            break
        except OutOfResources as exc:
            if exc.name != "shared memory" or stages == 1 or not FIT_STAGES:
                raise GDNCapabilityError(exc.name, f"{kernel.fn.__name__} needs {exc.required} at {stages} "
                                         f"pipeline stage(s); this GPU has {exc.limit}") from exc
            stages -= 1
    if stages == tuned:
        return
    key = key or _fit_key(kernel, tuned, options)
    if key not in _FITTED_STAGES:
        warnings.warn(f"GDN triton: {kernel.fn.__name__} does not fit this GPU's shared memory at its tuned "
                      f"{tuned} pipeline stages; running it at {stages} (same results, slower than tuned)",
                      RuntimeWarning, stacklevel=3)
        _FITTED_STAGES[key] = stages


def _fit_key(kernel, tuned: int, options: dict) -> tuple:
    """A launch's identity for ``_FITTED_STAGES``: its shared memory depends on all of these."""
    device = torch.cuda.current_device() if not _interpret() and torch.cuda.is_available() else -1
    return (kernel.fn.__name__, device, tuned, tuple(options.items()))


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def flags(dtype: torch.dtype) -> dict:
    """PREC: precision of fp32 dots on tensor cores (tf32x3 keeps fp32 inputs fp32-accurate);
    UPCAST: the CPU interpreter's bf16 dot is unreliable, so upcast there."""
    return {"PREC": "tf32x3" if dtype == torch.float32 else "tf32", "UPCAST": _interpret()}


def dims(k: Tensor, v: Tensor):
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    return B, T, Hk, Hv, K, V, triton_cdiv(T, CHUNK_SIZE)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
