"""Context parallelism for softmax-attention (SDPA) cores.

- `match.py`      `find_sdpa_cores` → `SdpaMatch` (one per `scaled_dot_product_attention` call)
- `masks.py`      the local mask patterns a rewrite understands (others are refused)
- `fragments.py`  global masks, key validity, the attention call that replaces a core
- one file per method: `all_gather.py`, `ulysses.py`, `hybrid.py`, `head_tail.py`; each registers
  its `MethodSpec` at its bottom, and its wrappers (`cpcompile.wrappers`) make their `CPMethod` from it;
  `passes/cores.py` finds the cores and runs the method's rewrite on each
"""
