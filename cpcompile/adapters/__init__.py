"""Model adapters: how cpcompile recognises, calls and traces model-specific attention cores.

Each adapter registers itself (`methods.register_adapter`): `sdpa` for any module whose forward
calls `scaled_dot_product_attention` (traced through the module class's own forward), and
`qwen3_5_gdn` for Qwen3.5's Gated DeltaNet layers (traced through cpcompile's statement of the
layer, its core one custom-op node; its wrappers are the GDN CP methods a plan names), and
`local_compute` for a region a user's `local_compute_fn` takes over (traced through it).
"""
from . import local_compute, qwen3_5, sdpa  # noqa: F401  (each registers its adapter)
