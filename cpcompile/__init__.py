"""cpcompile: context parallelism for PyTorch training by compiler passes over the model graph.

    plan = cpcompile.load_plan("train.yaml")
    mesh = cpcompile.build_mesh(plan.accelerator)
    model = cpcompile.compile(model, mesh, plan, dump_dir="cp_dump")
    local = cpcompile.shard_batch(global_batch, mesh, plan)
    loss = model(**local).loss
"""
from .batch import shard_batch, unshard
from .errors import (
    AlreadyCompiledError, CheckpointError, CoverageError, CPCompileError, CPConfigError, CPInputError, GDNCapabilityError,
    MissingDependencyError, NonFiniteError, PlanError, UnsupportedError, UnsupportedMaskError, VerificationError,
)
from .loss import all_reduce_gradients, global_mean_loss
from .mesh import CPMesh, build_mesh, release_process_group
from . import primitives
from .methods import CPMethod, allow_wrapper_module, inner_wrapper, register_inner_wrapper
from .methods.local_compute import local_compute_fn
from . import builtin_methods  # noqa: F401  (cpcompile's own methods and adapters, into the registry)
from .pipeline import compile
from .plan import AcceleratorConfig, Override, Plan, load_plan

__all__ = [
    "AcceleratorConfig", "AlreadyCompiledError", "CPCompileError", "CheckpointError", "CPConfigError", "CPInputError", "CPMesh",
    "CPMethod", "CoverageError", "GDNCapabilityError", "MissingDependencyError", "NonFiniteError", "Override", "Plan", "PlanError",
    "UnsupportedError", "UnsupportedMaskError", "VerificationError", "all_reduce_gradients", "allow_wrapper_module",
    "build_mesh", "compile", "global_mean_loss", "inner_wrapper", "load_plan", "local_compute_fn", "primitives",
    "register_inner_wrapper", "release_process_group",
    "shard_batch", "suggest_plan", "unshard",
]


def __getattr__(name: str):
    # the suggestion uses the trainer's memory and balance models: imported when first asked for,
    # so that `import cpcompile` does not load the trainer
    if name == "suggest_plan":
        from .suggest import suggest_plan
        return suggest_plan
    raise AttributeError(f"module 'cpcompile' has no attribute {name!r}")
__version__ = "0.1.0"
