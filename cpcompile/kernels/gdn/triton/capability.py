"""Capability check for the Triton GDN backend: runs at first use, names the failing capability,
never falls back to another backend.

Supported:
- device: CUDA with compute capability >= 8.0; Ascend NPU (``torch_npu`` + triton-ascend >= 3.2.1;
  code path present, never run by this project); CPU only under ``TRITON_INTERPRET=1`` (tests);
- dtypes: q, k, v, beta in bf16 or fp32 (one dtype for q, k, v); g any float dtype (read as fp32);
  initial state / state gradients fp32-castable;
- head dims: K and V in {16, 32, 64, 128}, on a GPU 64 or 128 (16 and 32 gave NaN outputs and key
  gradients on an H100, Triton 3.6, 2026-12-06; they run in the interpreter); value heads a
  multiple of key heads;
- chunk size 64; any length 1 <= T < 2^31 - 64 (a partial last chunk is masked): every offset that
  grows with B or T is int64, so memory is the limit;
- batch x value heads at most 65535 (grid axis 1).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from ....errors import GDNCapabilityError
from ..common import CHUNK_SIZE

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
MIN_GPU_HEAD_DIM = 64  # 16 and 32 gave NaN on an H100 (tests/kernels/test_gdn_triton.py, small head dims)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
MIN_CUDA_CC = (8, 0)
MIN_TRITON_ASCEND = (3, 2, 1)
MAX_GRID_YZ = 65535  # programs along grid axis 1 or 2 (CUDA); axis 0 holds 2^31 - 1
# Chunks a sequence may have: what has run on a GPU. Offsets are int64 and the output kernels keep
# chunks on grid axis 0, but a 4M-token run (65601 chunks) hit an illegal memory access on an H200
# (2026-12-02, tests/kernels/test_gdn_triton_long.py) whose cause is not found yet: refuse past it.
MAX_CHUNKS = 65535
MAX_T = MAX_CHUNKS * CHUNK_SIZE  # 4,194,240 tokens a sequence


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def require_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise GDNCapabilityError("dependency", "triton is not installed (pip install triton)") from exc


@functools.lru_cache(maxsize=None)
def check_device(device_type: str, index: int | None) -> None:
    """Device-level checks, cached per device (they touch drivers and imports)."""
    require_triton()
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device_type == "cpu":
        if not interpret:
            raise GDNCapabilityError("device", "cpu tensors need TRITON_INTERPRET=1 (interpreter, tests only)")
        return
    if device_type == "cuda":
        if interpret:
            raise GDNCapabilityError("device", "TRITON_INTERPRET=1 runs on CPU tensors only; got cuda tensors")
        cc = torch.cuda.get_device_capability(index)
        if cc < MIN_CUDA_CC:
            raise GDNCapabilityError("device", f"CUDA compute capability {cc[0]}.{cc[1]} < 8.0")
        return
    if device_type == "npu":
        # Ascend path: the kernels are plain Triton; triton-ascend compiles them. Present, unrun here.
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise GDNCapabilityError("device", "npu tensors need torch_npu") from exc
        version = _ascend_triton_version()
        if version is None or version < MIN_TRITON_ASCEND:
            raise GDNCapabilityError("dependency", f"triton-ascend >= 3.2.1 required; found {version}")
        return
    raise GDNCapabilityError("device", f"device type {device_type!r} (need cuda cc>=8.0, npu, or cpu+interpreter)")


def _ascend_triton_version() -> tuple[int, ...] | None:
    from importlib import metadata

    for dist in ("triton-ascend", "triton_ascend"):
        try:
            return _version_tuple(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return None


def check_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                 initial_state: Tensor | None = None, chunk_size: int = CHUNK_SIZE) -> None:
    """Shape/dtype checks (pure Python on tensor metadata; safe under tracing)."""
    if chunk_size != CHUNK_SIZE:
        raise GDNCapabilityError("chunk size", f"only {CHUNK_SIZE} is supported; got {chunk_size}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise GDNCapabilityError("shape", f"{name} must be [B, T, H, D]; got {tuple(t.shape)}")
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    if tuple(q.shape) != tuple(k.shape):
        raise GDNCapabilityError("shape", f"q {tuple(q.shape)} and k {tuple(k.shape)} differ")
    if tuple(v.shape[:2]) != (B, T):
        raise GDNCapabilityError("shape", f"v {tuple(v.shape)} does not match k {tuple(k.shape)} in [B, T]")
    if tuple(g.shape) != (B, T, Hv) or tuple(beta.shape) != (B, T, Hv):
        raise GDNCapabilityError("shape", f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [B, T, Hv]={(B, T, Hv)}")
    if T < 1:
        raise GDNCapabilityError("length", "sequence length must be >= 1")
    if Hv % Hk != 0:
        raise GDNCapabilityError("head count", f"value heads {Hv} must be a multiple of key heads {Hk}")
    if K not in SUPPORTED_HEAD_DIMS or V not in SUPPORTED_HEAD_DIMS:
        raise GDNCapabilityError("head dim", f"K={K}, V={V}; each must be one of {SUPPORTED_HEAD_DIMS}")
    if q.device.type == "cuda" and min(K, V) < MIN_GPU_HEAD_DIM:
        raise GDNCapabilityError("head dim", f"K={K}, V={V}; on {q.device.type} each must be at least "
                                 f"{MIN_GPU_HEAD_DIM} (smaller heads gave NaN on an H100)")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise GDNCapabilityError("dtype", f"q/k/v must share one of bf16/fp32; got {q.dtype}/{k.dtype}/{v.dtype}")
    if not g.dtype.is_floating_point or beta.dtype not in SUPPORTED_DTYPES:
        raise GDNCapabilityError("dtype", f"g must be floating, beta bf16/fp32; got {g.dtype}/{beta.dtype}")
    if initial_state is not None and tuple(initial_state.shape) != (B, Hv, K, V):
        raise GDNCapabilityError("shape", f"initial_state must be {(B, Hv, K, V)}; got {tuple(initial_state.shape)}")
    devices = {t.device for t in (q, k, v, g, beta, initial_state) if t is not None}
    if len(devices) != 1:
        raise GDNCapabilityError("device", f"all inputs must be on one device; got {sorted(map(str, devices))}")
    if B * Hv > MAX_GRID_YZ:
        # the per-head kernels put batch x value head on grid axis 1, which CUDA caps
        raise GDNCapabilityError("grid", f"B*Hv = {B}*{Hv} = {B * Hv} programs on one grid axis; at most "
                                 f"{MAX_GRID_YZ} (CUDA's limit on grid axes 1 and 2)")
    if T > MAX_T:
        raise GDNCapabilityError("length", f"T={T} is {-(-T // CHUNK_SIZE)} chunks of {CHUNK_SIZE}; at most "
                                 f"{MAX_CHUNKS} ({MAX_T} tokens) have run on a GPU: longer sequences failed there")


def check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
          initial_state: Tensor | None = None, chunk_size: int = CHUNK_SIZE) -> None:
    """All checks: inputs, then the device (cached)."""
    check_inputs(q, k, v, g, beta, initial_state, chunk_size)
    check_device(q.device.type, q.device.index)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_environment() -> None:
    """What can be checked before any tensor exists (when a GDN region is built, i.e. at
    ``cpcompile.compile``): triton importable, and a device the kernels can run on here."""
    require_triton()
    if _interpreting():
        return  # CPU tensors through Triton's interpreter (tests); cuda tensors are refused per call
    if torch.cuda.is_available():
        check_device("cuda", torch.cuda.current_device())
        return
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        check_device("npu", None)
        return
    raise GDNCapabilityError(
        "device", "no CUDA device (compute capability >= 8.0) or Ascend NPU is visible, and TRITON_INTERPRET=1 "
        "(the CPU interpreter, for tests) is not set")


def kernel_dtype(v: Tensor) -> torch.dtype:
    """The kernels' token dtype for a GDN layer's core: v's (the model's activation dtype).

    Qwen3.5's layer hands q and k over in fp32 (its L2 norm keeps fp32) beside bf16 v and beta;
    the kernels take one dtype for q, k, v, so q and k are cast to v's, as fla-core's kernels
    see them in transformers (bf16, normalised in the kernel).
    """
    if v.dtype not in SUPPORTED_DTYPES:
        raise GDNCapabilityError("dtype", f"v must be bf16 or fp32; got {v.dtype}")
    return v.dtype


def cast_and_check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                   chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """q, k in the kernel dtype and contiguous, after every input and device check (metadata only:
    also runs on fake tensors, so a GDN region fails at trace time, inside ``cpcompile.compile``).

    Cast and layout in one copy: Qwen3.5's q and k reach the core as fp32 views of the conv's
    channel-major output, and a cast alone keeps that layout (``preserve_format``), so every
    caller's ``.contiguous()`` then copied them a second time (forward, replay and backward).
    ``.to`` of a tensor already in the kernel dtype returns it as it is, even a dense permuted view
    (q of a one-row batch), hence the ``.contiguous()`` after it: a no-op when the cast copied."""
    dtype = kernel_dtype(v)
    for name, t in (("q", q), ("k", k)):
        if not t.dtype.is_floating_point:
            raise GDNCapabilityError("dtype", f"{name} must be floating; got {t.dtype}")
    q, k = (t.to(dtype, memory_format=torch.contiguous_format).contiguous() for t in (q, k))
    check(q, k, v, g, beta, initial_state, chunk_size)
    return q, k
