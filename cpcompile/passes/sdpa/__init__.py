"""Context parallelism for softmax-attention (SDPA) cores.

- `match.py`      `find_sdpa_cores` → `SdpaMatch` (one per `scaled_dot_product_attention` call)
- `masks.py`      the local mask patterns a rewrite understands (others are refused)
- `fragments.py`  global masks, key validity, the attention call that replaces a core
- `rewrite.py`    `sdpa_rewrite_pass`: every core of a region with the region's method
- one file per method: `all_gather.py`, `ulysses.py`, `hybrid.py`, `head_tail.py`; each registers
  its `MethodSpec` at its bottom, and its wrappers (`cpcompile.wrappers`) make their `CPMethod` from it
"""
from .rewrite import sdpa_rewrite_pass

__all__ = ["sdpa_rewrite_pass"]
