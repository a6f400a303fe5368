"""Packed documents through every GDN method on two GPUs over NCCL (`-m gpu`; CI has no GPU):
`gdn_packed_check.py` under torchrun, fp32, against each document run alone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_packed_gdn_on_nccl():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "gdn_packed_check.py"), "--device", "cuda"]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    print(res.stdout[-4000:])
    assert res.returncode == 0 and "PASS" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
