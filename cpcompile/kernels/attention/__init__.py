"""Local attention for the SDPA CP rewrites: fused kernels only, nothing quadratic in the sequence.

After its collectives a rank holds queries at known global positions and keys in global order, and
computes causal (or bidirectional) attention of those queries against the keys, honouring key
padding: `local_attention` (`local.py`), the one call the rewrites emit. It runs

- without padded keys: `cpcompile::chunk_attention` (`unmasked.py`): each query chunk attends to
  the keys before it in one unmasked kernel call and to its own diagonal block in one `is_causal`
  call, merged by log-sum-exp; the backward runs each block's fused backward against the merged
  output and log-sum-exp;
- with padded keys or documents: `cpcompile::varlen_attention` (`varlen.py`, CUDA bf16/fp16, head
  size up to 256): flash's variable-length kernel over segments cut at the key tags' runs;
  FlexAttention with a block mask built from block statistics (`flex.py`: CUDA fp32, larger heads,
  queries at given positions); or `cpcompile::tiled_attention` (`tiled.py`): query tiles against
  their visible key prefix with a tile-sized mask (the CPU).

`kernels.py` holds the per-block kernels (cuDNN and flash on CUDA; the fused CPU kernel) and picks them per device and dtype; `naive.py` is the float64 oracle of the tests.
"""
from .kernels import KERNELS, select_kernel
from .local import local_attention, local_attention_fake

__all__ = ["KERNELS", "local_attention", "local_attention_fake", "select_kernel"]
