"""Every SDPA method on two GPUs over NCCL, bf16, judged against fp32 (`-m gpu`, run through the
device tool; CI has no GPU). `benchmarks/cp_methods.py` does the judging: CP's error against the
unrewritten fp32 model at most 1.5x the single-device bf16 error (+1e-3), for loss, logits, all
gradients and the worst parameter; unpadded (cuDNN blocks) and padded (FlexAttention)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METHODS = ("all_gather", "ulysses", "head_tail", "async_all_gather", "async_ulysses")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


@pytest.mark.parametrize("padded", [False, True])
def test_every_sdpa_method_on_nccl(padded):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "cp_methods.py"), "--device", "cuda", "--methods", *METHODS,
           "--local-len", "2048", "--check-len", "1024", "--warmup", "1", "--repeat", "2"] + (["--padded"] if padded else [])
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    print(res.stdout[-4000:])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and line.split("|")[1].strip() in METHODS]
    assert len(rows) == 2 * len(METHODS) and all("| yes |" in r for r in rows), rows  # each row printed twice
