"""Test session set-up. Without CUDA, Triton kernels run in Triton's CPU interpreter, which
must be chosen before `cpcompile.kernels.gdn.triton` is first imported — so here, once, rather
than in each test module (import order between modules is not fixed)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every rewritten collective checks, in backward, that what reaches it is contiguous: gloo would
# accept anything, NCCL does not (cpcompile.collectives.check_gradient_layout). Ranks inherit it.
os.environ.setdefault("CPCOMPILE_STRICT_COLLECTIVES", "1")
