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
# decompositions, torch.export, which every cpcompile.compile or torch.compile in a rank needs;
# ~1.3 s more for transformers and the model classes the tests build, which nearly every rank
# needs, and a few torch modules that a rank's first export or FSDP wrap would import).
# Imports only: no op runs here, so no thread pool exists before a fork (see dist_utils' note on
# libgomp); importing transformers starts no thread either. An earlier try with transformers here
# (Dec 2) saw tests/plan/test_mesh.py::test_four_gloo_ranks hang in runs of tests/plan; on Dec 6
# it passed in 3 runs of tests/plan. If it hangs again, look here first.
import warnings  # noqa: E402

with warnings.catch_warnings():  # an import-time torch.jit deprecation notice, not the tests'
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._functorch.partitioners  # noqa: F401
    import torch._export.passes.replace_autocast_with_hop_pass  # noqa: F401
    import torch._export.passes.replace_set_grad_with_hop_pass  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.compiler_bisector  # noqa: F401
    import torch._inductor.decomposition  # noqa: F401
    import torch._subclasses.schema_check_mode  # noqa: F401
    import torch.distributed._composable.fsdp  # noqa: F401
    import torch.export._trace  # noqa: F401
    import torch.fx.experimental.validator  # noqa: F401
    import transformers  # noqa: F401
    import transformers.loss.loss_utils  # noqa: F401
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM, Trainer  # noqa: F401

    import model_zoo  # noqa: E402

    model_zoo.import_architectures()
