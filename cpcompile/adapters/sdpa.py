"""Regions around a softmax-attention (SDPA) core: traced through the module's own forward.

Besides preparing calls, the adapter reads what the region's attention modules declare about
their attention (`declared_attention`): the traced SDPA call alone cannot say whether attention
is causal at one local token, nor whether a sliding window cuts the global sequence.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..context import DeclaredAttention
from ..documents import GLOBAL_POSITIONS, QUERY_POSITIONS, UNMASKED_KWARG
from ..errors import CPInputError
from ..methods import HEAD_TAIL, AdapterSpec, register_adapter

CACHE_KWARGS = ("past_key_values", "past_key_value", "cache")
SLIDING_LAYER = "sliding_attention"  # transformers' `config.layer_types` entry for a windowed layer
CHUNKED_LAYER = "chunked_attention"  # ... and for a layer attending within fixed chunks (Llama-4)


class SdpaRegion:
    """A Head-Tail region (`per_document`) takes one more call argument, `cp_query_positions`: the
    global positions of the rank's tokens when the batch is packed, and so cut per document
    (`documents.per_document_head_tail`; None otherwise). They are read off the `position_ids`
    the attention is called with (`shard_batch` marks them there), so the recompute of a
    checkpointed layer reads its own batch's, whatever ran since. The module never sees them: they
    stay a graph input for the rewrite (`passes/sdpa/head_tail.py`)."""

    # the module's own code runs in the region: audit it for ops reading the local length (audit/local_length.py)
    audits_local_length = True
    # takes `cp_unmasked` (`documents.unmasked_keys`): its rewrite picks the attention kernel by it, the module
    # never sees it
    reads_unmasked = True

    def __init__(self, per_document: bool = False):
        self.reads_global_positions = per_document

    def prepare_call(self, fqn: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.reads_global_positions:
            kwargs = {**kwargs, QUERY_POSITIONS: getattr(kwargs.get("position_ids"), GLOBAL_POSITIONS, None)}
        for name in CACHE_KWARGS:
            if kwargs.get(name) is not None:
                raise CPInputError(
                    f"{fqn}: called with {name}={type(kwargs[name]).__name__}; CP does not support an "
                    "inference cache or incremental decoding — call the model with use_cache=False "
                    "(cpcompile.shard_batch adds it)"
                )
        return args, kwargs

    def forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop(QUERY_POSITIONS, None)
        kwargs.pop(UNMASKED_KWARG, None)
        # the class's forward: the instance's may already be cpcompile's replacement
        return type(module).forward(module, *args, **kwargs)

    def declared_attention(self, fqn: str, module: nn.Module) -> DeclaredAttention:
        """Causality and the narrowest sliding window declared by the attention modules in the
        region (transformers attention modules carry `is_causal`; the region may be one of them
        or contain several)."""
        attention = [(name, m) for name, m in module.named_modules() if isinstance(getattr(m, "is_causal", None), bool)]
        causal = {m.is_causal for _, m in attention}
        windows = [(window, name) for name, m in attention if (window := declared_window(m)) is not None]
        window, where = min(windows) if windows else (None, "")
        chunks = [(chunk, name) for name, m in attention if (chunk := declared_chunk(m)) is not None]
        chunk, chunk_where = min(chunks) if chunks else (None, "")
        return DeclaredAttention(
            causal=causal.pop() if len(causal) == 1 else None,
            window=window,
            window_module=f"{fqn}.{where}" if where else fqn,
            chunk=chunk,
            chunk_module=f"{fqn}.{chunk_where}" if chunk_where else fqn,
        )


def declared_window(module: nn.Module) -> int | None:
    """The sliding window a transformers attention module applies, or None.

    transformers states it in one of two ways: the module's own `sliding_window` (None on the
    full-attention layers of a mixed model; some modules also say `is_sliding`), or — for
    Mistral-style modules without that attribute — its config's `sliding_window`, on the layers
    `config.layer_types` marks as sliding (all of them when the config lists no layer types).
    """
    if getattr(module, "is_sliding", True) is False:
        return None
    if hasattr(module, "sliding_window"):
        return _positive_int(module.sliding_window)
    config = getattr(module, "config", None)
    layer_types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if layer_types is not None and isinstance(layer, int) and layer < len(layer_types) and layer_types[layer] != SLIDING_LAYER:
        return None
    return _positive_int(getattr(config, "sliding_window", None))


def declared_chunk(module: nn.Module) -> int | None:
    """The attention chunk a transformers attention module applies, or None: its config's
    `attention_chunk_size` on the layers `config.layer_types` marks `chunked_attention` (Llama-4's
    RoPE layers). transformers builds that mask outside the attention, from the call's positions,
    and when a chunk is at least a rank's shard the shard's mask looks plainly causal."""
    config = getattr(module, "config", None)
    chunk = _positive_int(getattr(config, "attention_chunk_size", None))
    layer_types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if chunk is None:
        return None
    if layer_types is None:  # a config that names no layer types: Llama-4 chunks its RoPE layers
        return None if getattr(module, "use_rope", True) in (0, False) else chunk
    if not isinstance(layer, int) or layer >= len(layer_types) or layer_types[layer] != CHUNKED_LAYER:
        return None
    return chunk


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


register_adapter(AdapterSpec("sdpa", core="sdpa", region=lambda method: SdpaRegion(method.layout == HEAD_TAIL)))
