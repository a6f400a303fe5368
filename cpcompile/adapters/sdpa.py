"""Regions around a softmax-attention (SDPA) core: traced through the module's own forward."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import CPInputError
from ..methods import AdapterSpec, register_adapter

CACHE_KWARGS = ("past_key_values", "past_key_value", "cache")


class SdpaRegion:
    def prepare_call(self, fqn: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for name in CACHE_KWARGS:
            if kwargs.get(name) is not None:
                raise CPInputError(
                    f"{fqn}: called with {name}={type(kwargs[name]).__name__}; CP does not support an "
                    "inference cache or incremental decoding — call the model with use_cache=False "
                    "(cpcompile.shard_batch adds it)"
                )
        return args, kwargs

    def forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # the class's forward: the instance's may already be cpcompile's replacement
        return type(module).forward(module, *args, **kwargs)


register_adapter(AdapterSpec("sdpa", core="sdpa", region=lambda method: SdpaRegion()))
