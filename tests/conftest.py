"""Test session set-up.

Tests live by area (`plan/`, `methods/`, `batch/`, `pipeline/`, `sdpa/`, `async/`, `gdn/`,
`kernels/`, `models/` (transformers architectures), `train/`, `benchmarks/`); the shared
harnesses stay here (`cp_harness`, `gdn_harness`, `model_zoo`, `dist_utils`) and are imported by name, so this folder goes on `sys.path` (ranks
started by `dist_utils` inherit it).

Without CUDA, Triton kernels run in Triton's CPU interpreter, which must be chosen before
`cpcompile.kernels.gdn.triton` is first imported — so here, once, rather than in each test module
(import order between modules is not fixed)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every rewritten collective checks, in backward, that what reaches it is contiguous: gloo would
# accept anything, NCCL does not (cpcompile.collectives.check_gradient_layout). Ranks inherit it.
os.environ.setdefault("CPCOMPILE_STRICT_COLLECTIVES", "1")
