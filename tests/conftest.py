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

# Ranks started by `dist_utils` are forked from this process: what it has imported they inherit
# instead of importing it again (~2 s of CPU per rank on the CI box: AOT autograd, Inductor's
# decompositions, torch.export, which every cpcompile.compile or torch.compile in a rank needs).
# Imports only: no op runs here, so no thread pool exists before a fork (see dist_utils' note on
# libgomp). Not transformers: with it imported here, tests/plan/test_mesh.py::test_four_gloo_ranks
# hung (all 4 ranks, in a run of tests/plan) every time it was tried.
import warnings  # noqa: E402

with warnings.catch_warnings():  # an import-time torch.jit deprecation notice, not the tests'
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._functorch.partitioners  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.decomposition  # noqa: F401
    import torch.export._trace  # noqa: F401
