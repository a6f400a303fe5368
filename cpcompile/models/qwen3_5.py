"""Alias of `cpcompile.adapters.qwen3_5` for plans that name the GDN wrappers by their old dotted
path, e.g. `_target_: cpcompile.models.qwen3_5.qwen3_5_gdn_p2p_cp_wrapper`. It imports the marked
wrappers (nothing is defined or registered twice)."""
from ..adapters.qwen3_5 import (  # noqa: F401
    qwen3_5_gdn_all_gather_cp_wrapper,
    qwen3_5_gdn_p2p_cp_wrapper,
    qwen3_5_gdn_ulysses_cp_wrapper,
)

__all__ = ["qwen3_5_gdn_all_gather_cp_wrapper", "qwen3_5_gdn_p2p_cp_wrapper", "qwen3_5_gdn_ulysses_cp_wrapper"]
