"""Built-in inner wrappers for softmax attention (SDPA). Each fixes one CP method."""
from __future__ import annotations

from .methods import CONTIGUOUS, CPMethod
from .registry import inner_wrapper


@inner_wrapper
def sdpa_hf_cp_wrapper() -> CPMethod:
    """AllGather ("Colossal") CP for a Hugging Face attention module calling SDPA.

    Q stays local; K and V are all-gathered over the `cp` mesh (backward: reduce-scatter);
    the causal mask is rebuilt with the local query block's global offset.
    """
    return CPMethod(name="all_gather", core="sdpa", wrapper="sdpa_hf_cp_wrapper", layout=CONTIGUOUS)


@inner_wrapper
def sdpa_qkv_cp_wrapper() -> CPMethod:
    """AllGather CP for a core-attention module whose forward takes (q, k, v) and calls SDPA."""
    return CPMethod(name="all_gather", core="sdpa", wrapper="sdpa_qkv_cp_wrapper", layout=CONTIGUOUS)
