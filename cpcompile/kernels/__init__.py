"""GDN kernels: the eager oracle (``gdn_eager``) and the Triton backend (``triton_gdn``).

Importing this package never imports triton; ``chunk_gated_delta_rule(..., backend="triton")``
loads it on first use.
"""

from .api import chunk_gated_delta_rule

__all__ = ["chunk_gated_delta_rule"]
