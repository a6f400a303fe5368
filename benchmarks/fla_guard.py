"""fla-core 0.6 refuses its gated backward on Hopper with Triton >= 3.4 and < 3.7.1 (its issue #640:
a Triton miscompile). The benchmarks that time or compare fla-core lift that guard; no correctness
claim of cpcompile rests on fla-core's gradients there (gdn_kernels.py says how)."""
from __future__ import annotations


def lift_fla_hopper_guard() -> None:
    """Let fla-core's gated backward run on Hopper with this Triton (ImportError without fla-core).
    Refuses an fla-core whose guard is not where 0.6 keeps it, rather than lifting nothing."""
    import fla.ops.common.chunk_o as fla_chunk_o

    if not hasattr(fla_chunk_o, "TRITON_ABOVE_3_7_1"):
        raise RuntimeError("fla.ops.common.chunk_o has no TRITON_ABOVE_3_7_1: this fla-core keeps its Hopper "
                           "guard elsewhere; see benchmarks/fla_guard.py")
    fla_chunk_o.TRITON_ABOVE_3_7_1 = True
