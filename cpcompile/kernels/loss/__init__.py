"""The chunked loss's per-chunk elementwise work as Triton kernels (`triton_chunk.py`) and their
float64 oracle (`naive.py`). Importing this package never imports triton."""
