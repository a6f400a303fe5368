"""A Hugging Face model's softmax attention on cpcompile's local attention kernels, for a model that
runs without CP (the trainer at cp_size 1): `route_attention(model)`.

Why: without CP, transformers turns a packed batch's position ids, or a padded batch's attention
mask, into a dense `[B, 1, S, S]` mask, and SDPA runs the whole causal square with it (at 32K tokens
of packed chat documents, 917 ms of attention against 205 ms unpacked:
benchmarks/results/compiled_cp_2026-12-06_NVIDIA-H100.md). The CP regions never build such a mask:
their `local_attention` takes one tag a key (`kernels/attention/layout.py`) and, with padding or
documents, skips the blocks no query sees (FlexAttention on CUDA). This module gives the model
without CP the same kernel, as an attention implementation of transformers' own registry
(`AttentionInterface`), named `NAME`, with a mask function that passes the 2-D padding mask on as it
is: nothing `S x S` is built.

Which kernel runs is `cp_unmasked`, a plain bool of the layer's call (`DocumentFeed.hand_to_layer`,
from the mark `shard_batch` leaves on the position ids): the unmasked cuDNN blocks when no real
query of the batch may see a padded key or one of another document under causality (one document
a row, padded on the right if at all: `documents.causally_unmasked_keys`), else the masked kernel.
Under `torch.compile` it is a constant of the layer's graph. A non-causal attention does not trust
it (right padding would be visible there), nor does any call without it (a batch `shard_batch` did
not mark): the kernel then reads the tags, eagerly, or takes the masked path, exact for any batch.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from ..documents import DOCUMENTS_KWARG, UNMASKED_KWARG, DocumentFeed
from ..errors import CPInputError, UnsupportedError
from ..kernels.attention import local_attention
from ..kernels.attention.kernels import select_kernel

NAME = "cpcompile_local"


def route_attention(model: nn.Module) -> None:
    """Run `model`'s softmax attention through `local_attention_forward`: register it once, and set the
    model's attention implementation to it. Refuses what it does not compute (sliding windows)."""
    windows = sorted({name for name, m in model.named_modules() if getattr(m, "sliding_window", None)})
    if windows:
        raise UnsupportedError(f"{windows[0]} attends within a sliding window, which cpcompile's local attention "
                               "without CP does not compute; run the model with cp_size > 1 or without windows")
    register()
    # the text model's layers read their implementation from the text config (a composite model's
    # other towers, a vision encoder's attention, keep theirs)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config._attn_implementation = NAME


def route_attention_without_cp(model: nn.Module, layers: nn.ModuleList) -> int:
    """`route_attention`, and each decoder layer with softmax attention (`self_attn`) handed its call's
    documents and unmasked fact as keywords (`DocumentFeed.hand_to_layer`, from the model call's
    position ids and `shard_batch`'s mark); -> how many layers. Keywords, not a read of the feed at
    call time: a checkpointed layer's replay must see the batch of its own forward. Layers without
    softmax attention (GDN) are left alone: some transformers versions' GDN layers take no extra keywords."""
    route_attention(model)
    feed = DocumentFeed(marked_only=False).follow(model)
    hooked = [layer for layer in layers if isinstance(getattr(layer, "self_attn", None), nn.Module)
              and _takes_keywords(layer.forward) and _takes_keywords(layer.self_attn.forward)]
    for layer in hooked:
        layer.register_forward_pre_hook(feed.hand_to_layer, with_kwargs=True)
    return len(hooked)


def _takes_keywords(function) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, local_attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)


def padding_mask(*_args, attention_mask: torch.Tensor | None = None, **_kwargs) -> torch.Tensor | None:
    """The mask function transformers calls for `NAME`: the 2-D padding mask `[B, S]` (bool) as it
    came, or None; the attention builds its key tags from it and the position ids."""
    return attention_mask


def local_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            position_ids: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function contract: `query [B, Hq, S, D]`, `key`/`value [B, Hkv, S, D]`
    (before any repeat: the kernels take grouped heads), `attention_mask` what `padding_mask` returned;
    -> (`[B, S, Hq, D]`, None)."""
    positions = kwargs.get(DOCUMENTS_KWARG)  # the model call's, when handed down; else the layer's own
    positions = position_ids if positions is None else positions
    refuse_what_it_cannot_compute(module, query, key, dropout, positions, kwargs.get("sliding_window"))
    query, key, value = at_autocast_precision(query, key, value)
    value_size = value.shape[-1]
    tags = key_tags(positions, attention_mask, query.shape[0], key.shape[2], query.device)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # multi-head latent attention's value head size differs: zero-padded, as the CP rewrite does
    # (passes/sdpa/fragments.equal_head_sizes: exact, the padded output columns cut off)
    width = max(query.shape[-1], value.shape[-1])
    kernel = select_kernel(query.device, query.dtype)
    masked_kernel = select_kernel(query.device, query.dtype, masked=True, head_dim=width)
    causal = bool(getattr(module, "is_causal", True))
    unmasked = kwargs.get(UNMASKED_KWARG) if causal else None  # the mark is a causal fact (module doc)
    query, key, value = (F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x for x in (query, key, value))
    out = local_attention(query, key, value, tags, [0], causal, float(scale), kernel, masked_kernel, None, unmasked)
    return out[..., :value_size].transpose(1, 2), None


def at_autocast_precision(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q, K and V as SDPA would take them: under autocast each is cast to its dtype (SDPA is on
    autocast's lower-precision list). `local_attention` itself runs outside autocast at its inputs'
    precision, and Qwen3-style models hand it fp32 Q and K (their rotary embedding is fp32) beside a
    bf16 V, which no fused kernel takes."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in tensors)


def refuse_what_it_cannot_compute(module: nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float,
                                  positions: torch.Tensor | None, sliding_window) -> None:
    where = type(module).__name__
    if dropout:
        raise CPInputError(f"{where}: attention dropout ({dropout}) is not supported by cpcompile's local attention "
                           "kernels; set the model's attention dropout to 0")
    if key.shape[2] != query.shape[2]:
        raise UnsupportedError(f"{where}: {query.shape[2]} queries against {key.shape[2]} keys (a cache): cpcompile's "
                               "local attention routing is for training steps")
    if sliding_window is not None:
        raise UnsupportedError(f"{where}: a sliding window ({sliding_window}), which cpcompile's local attention "
                               "without CP does not compute")
    if positions is None:
        raise UnsupportedError(f"{where}: called without position ids, so the batch's documents are unknown; "
                               "cpcompile's local attention needs the model to pass `position_ids` on")


def key_tags(position_ids: torch.Tensor, padding: torch.Tensor | None, batch: int, length: int,
             device: torch.device) -> torch.Tensor:
    """`[B, S]` int64, as `kernels/attention/layout.py` defines them: where each key's document starts
    (its position minus its position id; position ids restart at 0 at each packed document), or
    −(that + 1) for a padded key."""
    positions = position_ids[0] if position_ids.dim() == 3 else position_ids  # multimodal [n, B, S]: text first
    starts = (torch.arange(length, device=device) - positions.long()).expand(batch, length)
    if padding is None:
        return starts.contiguous()
    return torch.where(padding.bool(), starts, -starts - 1)

