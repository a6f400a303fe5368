"""Local attention for the SDPA CP rewrites: fused kernels only, nothing quadratic in the sequence.

After its collectives a rank holds queries at known global positions and keys in global order, and
must compute causal (or bidirectional) attention of those queries against the keys, honouring key
padding. One custom op does it, `cpcompile::chunk_attention` (`op.py`):

- no padded key (checked on the gathered key validity, one flag read back per call): each query
  chunk attends to the keys before it in one unmasked kernel call and to its own diagonal block
  in one `is_causal` call, merged by log-sum-exp (`unmasked.py`); the backward runs each block's
  fused backward against the merged output and log-sum-exp;
- padded keys: query tiles attend to their visible key prefix with a tile-sized mask
  (`tiled.py`), so the largest mask is `tile × S_kv`, never `S_q × S_kv`.

`kernels.py` holds the per-block kernels (flash, cuDNN, memory-efficient on CUDA; the fused CPU
kernel) and picks them per device and dtype; `naive.py` is the float64 oracle of the tests.
"""
from .kernels import KERNELS, select_kernel
from .op import chunk_attention

__all__ = ["KERNELS", "chunk_attention", "select_kernel"]
