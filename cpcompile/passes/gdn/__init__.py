"""Context parallelism for Gated DeltaNet (GDN) cores.

- `match.py`      `find_gdn_cores` → `GdnMatch` (the `cpcompile::gdn_chunk` node and its conv pad)
- `fragments.py`  sequence↔head exchange, the summary algebra as graph nodes
- `rewrite.py`    `gdn_rewrite_pass`: the conv halo, then the region's method
- one file per method: `ulysses.py`, `p2p.py` (State-P2P), `all_gather.py` (State-AllGather); each
  registers its `MethodSpec`, and the model adapter's wrappers (`adapters/qwen3_5.py`) use it
"""
from .rewrite import gdn_rewrite_pass

__all__ = ["gdn_rewrite_pass"]
