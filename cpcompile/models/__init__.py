"""Alias package: the model adapters live in `cpcompile.adapters`. Kept so that plans naming the
Qwen3.5 GDN wrappers by their old dotted path (`cpcompile.models.qwen3_5.<wrapper>`) keep working."""
