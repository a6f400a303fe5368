"""GDN in Head-Tail order beside SDPA Head-Tail on 2 and 4 GPUs over NCCL, bf16 judged against fp32
as `cpcompile.parity` does (`-m gpu`; CI has no GPU): `gdn_head_tail_check.py` under torchrun, the
scenarios of test_gdn_head_tail.py on the triton backend, and the op at Qwen3.5's head shape."""
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


@pytest.mark.parametrize("world", [2, 4])
def test_head_tail_gdn_on_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           os.path.join(HERE, "gdn_head_tail_check.py"), "--device", "cuda"]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    print(res.stdout[-4000:])
    assert res.returncode == 0 and "PASS" in res.stdout.splitlines(), res.stdout[-3000:] + res.stderr[-3000:]
