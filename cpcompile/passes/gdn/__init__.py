"""Context parallelism for Gated DeltaNet (GDN) cores.

- `match.py`      `find_gdn_cores` → `GdnMatch` (the `cpcompile::gdn_chunk` node and its conv pad)
- `fragments.py`  sequence↔head exchange, the summary algebra as graph nodes
- `conv_halo.py`  `gdn_method` (a GDN method's spec) and the conv halo every method fills first
- one file per method: `ulysses.py`, `p2p.py` (State-P2P), `all_gather.py` (State-AllGather); each
  registers its `MethodSpec`, and the model adapter's wrappers (`adapters/qwen3_5.py`) use it;
  `passes/cores.py` finds the core and runs the halo, then the method's rewrite
"""
