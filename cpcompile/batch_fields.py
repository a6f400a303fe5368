"""What a global batch given to `shard_batch` may hold, and the checks it passes before anything is
sliced: the fields cut along the sequence (`SEQ_DIM`, with their sequence dimension), the entries
passed through unchanged, those accepted only with a harmless value, those refused with the
reason (inference cache, varlen metadata), and the shapes and dtypes of the token fields. Every
refusal is a `CPInputError` naming the key (docs/batch.md).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .errors import CPInputError

# Fields cut along the sequence dimension, and where that dimension is.
SEQ_DIM = {
    "input_ids": 1,
    "inputs_embeds": 1,
    "attention_mask": 1,
    "labels": 1,
    "shift_labels": 1,
    "position_ids": -1,  # [B, S], [1, S] or multimodal-rope [n, B, S]
}

# Non-sequence entries passed through unchanged (flags, or a user-chosen loss normaliser).
PASSTHROUGH_KEYS = frozenset(
    {"return_dict", "output_hidden_states", "output_attentions", "output_router_logits", "num_items_in_batch"}
)
# Accepted only with a harmless value; anything else is refused with the reason below.
_HARMLESS_VALUES = {
    "use_cache": (None, False),
    "past_key_values": (None,),
    "logits_to_keep": (None, 0),
    "is_causal": (None, True),
}
_REJECT_REASONS = {
    "use_cache": "training with CP has no KV cache; pass use_cache=False or leave it out",
    "past_key_values": "an inference KV cache cannot be split across CP ranks",
    "logits_to_keep": "CP training needs logits for every token (logits_to_keep=0)",
    "is_causal": "CP attention rewrites assume causal attention",
    "cache_position": "cache_position is inference metadata; shard_batch supplies global position_ids",
    "cu_seq_lens_q": "pass a packed batch as position_ids restarting at 0 per document, or as cu_seq_lens",
    "cu_seq_lens_k": "pass a packed batch as position_ids restarting at 0 per document, or as cu_seq_lens",
    "max_length_q": "shard_batch derives what CP needs of a packed batch from its position ids",
    "max_length_k": "shard_batch derives what CP needs of a packed batch from its position ids",
    "seq_idx": "pass a packed batch as position_ids restarting at 0 per document, or as cu_seq_lens",
}
PACKING_KEYS = frozenset({"cu_seq_lens"})  # consumed by shard_batch: it becomes position ids
ALLOWED_KEYS = frozenset(SEQ_DIM) | PASSTHROUGH_KEYS | frozenset(_HARMLESS_VALUES) | PACKING_KEYS


def check_keys(batch: Mapping[str, Any]) -> None:
    for key, value in batch.items():
        if key in _HARMLESS_VALUES:
            if value is None or (not isinstance(value, torch.Tensor) and value in _HARMLESS_VALUES[key]):
                continue
            raise CPInputError(f"shard_batch: {key}={value!r} is not supported: {_REJECT_REASONS[key]}")
        if key in _REJECT_REASONS:
            raise CPInputError(f"shard_batch: {key!r} is not supported: {_REJECT_REASONS[key]}")
        if key not in ALLOWED_KEYS:
            kind = "tensor" if isinstance(value, torch.Tensor) else "entry"
            raise CPInputError(
                f"shard_batch: unknown {kind} {key!r}; CP cannot guess how to split it. "
                f"Allowed keys: {', '.join(sorted(ALLOWED_KEYS))}"
            )
        if key in SEQ_DIM and value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"shard_batch: {key!r} must be a tensor, got {type(value).__name__}")


def sequence_shape(batch: Mapping[str, Any]) -> tuple[int, int]:
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    if (ids is None) == (embeds is None):
        raise CPInputError("shard_batch: pass exactly one of 'input_ids' [B, S] or 'inputs_embeds' [B, S, H]")
    if ids is not None and ids.dim() != 2:
        raise CPInputError(f"shard_batch: 'input_ids' must be [B, S], got shape {tuple(ids.shape)}")
    if embeds is not None and embeds.dim() != 3:
        raise CPInputError(f"shard_batch: 'inputs_embeds' must be [B, S, H], got shape {tuple(embeds.shape)}")
    main = ids if ids is not None else embeds
    if main.numel() == 0:
        name = "input_ids" if ids is not None else "inputs_embeds"
        raise CPInputError(f"shard_batch: the batch is empty ({name!r} has shape {tuple(main.shape)}); "
                           "CP needs at least one sequence of at least one token")
    return main.shape[0], main.shape[1]


def check_token_dtypes(batch: Mapping[str, Any]) -> None:
    """Token ids and labels index the vocabulary: a float tensor there would fail deep in the
    embedding (or the loss) of one forward, so it is refused here, on every rank alike."""
    for key in ("input_ids", "labels", "shift_labels"):
        value = batch.get(key)
        if value is None or not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
            continue
        hint = "; pass embeddings as 'inputs_embeds'" if key == "input_ids" else ""
        raise CPInputError(f"shard_batch: {key!r} must hold integer token ids, got {value.dtype}{hint}")


def check_field_shapes(batch: Mapping[str, Any], bsz: int, seq_len: int) -> None:
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise CPInputError(
            f"shard_batch: 'attention_mask' has shape {tuple(mask.shape)}; pass the 2-D [B, S] padding mask, "
            "CP builds the causal/global attention mask itself"
        )
    for key in ("attention_mask", "labels", "shift_labels"):
        value = batch.get(key)
        if value is not None and tuple(value.shape) != (bsz, seq_len):
            raise CPInputError(f"shard_batch: {key!r} must have shape {(bsz, seq_len)}, got {tuple(value.shape)}")
    pos = batch.get("position_ids")
    if pos is not None:
        ok = (pos.dim() == 2 and pos.shape[0] in (1, bsz)) or (pos.dim() == 3 and pos.shape[1] in (1, bsz))
        if not ok or pos.shape[-1] != seq_len:
            raise CPInputError(
                f"shard_batch: 'position_ids' must be [B, S], [1, S] or [n, B, S] with S={seq_len}, B={bsz}; "
                f"got {tuple(pos.shape)}"
            )


