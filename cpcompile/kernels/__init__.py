"""Local kernels, one folder per algorithm: ``gdn/`` (the eager oracle and the Triton backend of
the Gated DeltaNet core).

Importing this package never imports triton; ``chunk_gated_delta_rule(..., backend="triton")``
loads it on first use.
"""

from .gdn import chunk_gated_delta_rule

__all__ = ["chunk_gated_delta_rule"]
