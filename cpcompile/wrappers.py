"""Built-in inner wrappers for softmax attention (SDPA). Each fixes one CP method.

A wrapper is called with the plan's parameters and returns a `CPMethod`, made from the method's
registered spec (registered in its pass file, `passes/sdpa/<method>.py`); the rewrite passes read
only that. Sync and async are different wrappers, never a flag in the plan.
"""
from __future__ import annotations

from .errors import CPInputError, short_repr
from .methods import CPMethod, inner_wrapper
from .passes.sdpa.all_gather import ALL_GATHER, ASYNC_ALL_GATHER
from .passes.sdpa.head_tail import LOAD_BALANCE
from .passes.sdpa.hybrid import ASYNC_HYBRID, HYBRID
from .passes.sdpa.ulysses import ASYNC_ULYSSES, ULYSSES


def _check_ulysses_degree(ulysses_degree: int) -> int:
    if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 2:
        raise CPInputError(f"ulysses_degree must be an integer >= 2, got {short_repr(ulysses_degree)}")
    return ulysses_degree


@inner_wrapper
def sdpa_hf_cp_wrapper() -> CPMethod:
    """AllGather ("Colossal"): Q stays local; K and V are all-gathered over `cp` (backward:
    reduce-scatter); the causal mask uses the local query block's global offset."""
    return ALL_GATHER.cp_method("sdpa_hf_cp_wrapper")


@inner_wrapper
def sdpa_qkv_cp_wrapper() -> CPMethod:
    """AllGather for a core-attention module whose forward takes (q, k, v) and calls SDPA."""
    return ALL_GATHER.cp_method("sdpa_qkv_cp_wrapper")


@inner_wrapper
def sdpa_hf_ulysses_cp_wrapper() -> CPMethod:
    """Ulysses: Q/K/V sequence→head all-to-all over `cp`, full-sequence attention on H/cp heads,
    output head→sequence all-to-all. The degree is always cp_size."""
    return ULYSSES.cp_method("sdpa_hf_ulysses_cp_wrapper")


@inner_wrapper
def sdpa_qkv_ulysses_cp_wrapper() -> CPMethod:
    """Ulysses for a core-attention module whose forward takes (q, k, v)."""
    return ULYSSES.cp_method("sdpa_qkv_ulysses_cp_wrapper")


@inner_wrapper
def sdpa_hf_hybrid_cp_wrapper(ulysses_degree: int) -> CPMethod:
    """Hybrid: all-to-all inside Ulysses sub-groups of `ulysses_degree` ranks, then K/V
    all-gather inside the ring sub-groups (1 < ulysses_degree < cp, cp % ulysses_degree == 0)."""
    return HYBRID.cp_method("sdpa_hf_hybrid_cp_wrapper", ulysses_degree=_check_ulysses_degree(ulysses_degree))


@inner_wrapper
def sdpa_hf_load_balance_cp_wrapper() -> CPMethod:
    """Head-Tail load balance on AllGather: rank r holds sequence chunks r and 2·cp−1−r."""
    return LOAD_BALANCE.cp_method("sdpa_hf_load_balance_cp_wrapper")


@inner_wrapper
def sdpa_hf_async_cp_wrapper() -> CPMethod:
    """Async AllGather: each K/V gather launches right after its producer and is waited right
    before attention, with the Q path scheduled in between."""
    return ASYNC_ALL_GATHER.cp_method("sdpa_hf_async_cp_wrapper")


@inner_wrapper
def sdpa_hf_async_ulysses_cp_wrapper() -> CPMethod:
    """Async Ulysses: each sequence→head all-to-all launches right after its producer."""
    return ASYNC_ULYSSES.cp_method("sdpa_hf_async_ulysses_cp_wrapper")


@inner_wrapper
def sdpa_hf_async_hybrid_cp_wrapper(ulysses_degree: int) -> CPMethod:
    """Async Hybrid: the all-to-all → all-gather chain stays asynchronous end to end."""
    return ASYNC_HYBRID.cp_method("sdpa_hf_async_hybrid_cp_wrapper",
                                   ulysses_degree=_check_ulysses_degree(ulysses_degree))
