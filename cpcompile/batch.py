"""The CP batch contract: turn one *global* micro-batch into this rank's local slice.

Everything that depends on the whole sequence is computed on the global batch, before any
slicing, so no rank ever has to guess what lies beyond its own slice:

1. validate keys (varlen metadata other than ``cu_seq_lens``, inference cache and unknown tensors
   are refused);
2. global ``position_ids`` (created as ``arange(S)`` when absent, or from ``cu_seq_lens``);
   restarts at 0 mark packed documents (`cpcompile.documents`);
3. global next-token targets ``shift_labels`` (``labels[:, 1:]`` + one ``-100``, and ``-100`` at the
   last token of every packed document; labels are otherwise taken as given, as Hugging Face does
   at CP=1), and ``num_items_in_batch`` = global target count;
4. right padding to the layout's multiple (only with ``pad=True``);
5. slicing along the sequence by the method's layout (contiguous or Head-Tail).

What a batch may hold, and the checks of step 1, are `batch_fields.py`. The pure index helpers
(`local_indices`, `reorder_for_layout`, `restore_order`) and the mark a sliced batch carries with
the guard a compiled model checks it with (`LayoutGuard`) are `sequence_layout.py`: they need no
process group; `unshard` is their distributed inverse.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from .documents import (
    GLOBAL_POSITIONS, TOKEN_ORDER, causally_unmasked_keys, end_documents, is_packed, mark_packed, mark_unmasked,
    per_document_head_tail, positions_from_cu_seq_lens, unmasked_keys,
)
from .batch_fields import PASSTHROUGH_KEYS, SEQ_DIM, check_field_shapes, check_keys, check_token_dtypes, sequence_shape
from .errors import CPConfigError, CPInputError
from .methods import CONTIGUOUS, HEAD_TAIL
from .plan import load_plan
from .sequence_layout import ShardLayout, local_indices, mark_layout, required_multiple, restore_order

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- the plan's layout on this rank




def _cp_size_and_rank(mesh: Any) -> tuple[int, int]:
    if mesh is None:
        return 1, 0
    return int(mesh.cp_size), int(mesh.cp_rank)


def _as_plan(plan: Any) -> Any:
    """A plan in any form `compile` takes (a YAML path, a dict or a `Plan`), loaded; None stays None."""
    if isinstance(plan, (Mapping, str, os.PathLike)):
        return load_plan(plan)
    return plan


def _batch_layout(mesh: Any, plan: Any) -> tuple[int, int, str]:
    plan = _as_plan(plan)
    cp_size, cp_rank = _cp_size_and_rank(mesh)
    plan_cp = getattr(plan, "cp_size", None)
    if plan_cp is not None and int(plan_cp) != cp_size:
        raise CPConfigError(f"plan has cp_size={plan_cp} but the mesh has cp_size={cp_size}")
    if cp_size == 1:  # nothing is sliced, so no layout is needed
        return cp_size, cp_rank, CONTIGUOUS
    layout = plan.layout() if plan is not None else None  # the one-layout rule (`plan.sequence_layout`)
    if layout is None:
        raise CPConfigError(f"cp_size={cp_size} but the plan has no active CP override to fix the sequence layout")
    return cp_size, cp_rank, layout


# ----------------------------------------------------------------------------- global fields


def global_shift_labels(labels: torch.Tensor, *, already_shifted: bool = False) -> torch.Tensor:
    """Next-token targets over the *whole* sequence: position i predicts labels[i+1].

    The last position gets -100. Labels are otherwise taken as given, exactly as Hugging Face
    does at CP=1 (it does not consult the padding mask): a collator that wants padding
    ignored sets those labels to -100, and the CP loss then equals the CP=1 loss.
    """
    if already_shifted:
        return labels.clone()
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def _pad_seq(tensor: torch.Tensor, extra: int, value: float | int, seq_dim: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[seq_dim] = extra
    filler = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, filler], dim=seq_dim)


def _pad_positions(position_ids: torch.Tensor, extra: int) -> torch.Tensor:
    """Continue each row's numbering past its last value: last+1, last+2, ..."""
    step = torch.arange(1, extra + 1, dtype=position_ids.dtype, device=position_ids.device)
    return torch.cat([position_ids, position_ids[..., -1:] + step], dim=-1)


# ----------------------------------------------------------------------------- public entry points


def shard_batch(
    global_batch: Mapping[str, Any], mesh: Any, plan: Any, *, pad: bool = False, pad_token_id: int = 0
) -> dict[str, Any]:
    """Return this CP rank's local batch, ready for ``model(**local)`` on a Hugging Face causal LM.

    Every rank of the CP group passes the same *global* micro-batch. ``mesh`` provides
    ``cp_size``/``cp_rank`` (None means cp=1); ``plan`` — a `Plan`, or a YAML path or dict as
    `compile` takes — fixes the layout by ``plan.layout()`` (all active overrides must need the
    same one). Every check runs on the global batch before anything is sliced, so every rank
    refuses the same batch with the same error: an empty batch, float token ids or labels,
    malformed packing, unknown keys.

    Returned keys: the sliced sequence fields (``input_ids`` | ``inputs_embeds``,
    ``attention_mask`` if given, ``position_ids`` always — global numbers, restarting at 0 only at the
    documents of a packed batch),
    and when labels are given: ``labels`` (local slice of the *unshifted* labels, so HF computes a
    loss), ``shift_labels`` (local slice of the globally shifted targets, which HF's
    ``ForCausalLMLoss`` uses instead of shifting locally) and ``num_items_in_batch`` (the number
    of valid targets in the whole global batch, so each rank's HF loss is its share and the sum
    over the CP group is the CP=1 mean). A user-given ``num_items_in_batch`` (e.g. a count over
    gradient-accumulation steps, or over DP ranks) passes through unchanged. Flags in
    ``PASSTHROUGH_KEYS`` pass through; ``use_cache=False`` is always set. The model's loss must
    honour ``shift_labels`` (HF ``ForCausalLMLoss`` does); one that shifts locally would drop the
    target at each rank boundary. The 2-D padding mask is sliced with its tokens; the rewritten
    attention is responsible for gathering the key-side padding it needs.

    At cp=1 (no active override) the same contract applies without slicing, so the CP=1
    reference run sees exactly the same fields and numbers.

    If S is not a multiple of cp (contiguous) or 2*cp (head_tail): ``pad=False`` raises;
    ``pad=True`` right-pads: ids with ``pad_token_id``, embeddings with 0, labels with -100,
    position ids continuing each row, and ``attention_mask`` with 0 (none is created when the
    user gave none: right padding is causally invisible to real tokens).

    Packed documents (`cpcompile.documents`): ``position_ids`` restarting at 0 at every document,
    or ``cu_seq_lens`` with one row (turned into such position ids). The last token of every
    document predicts nothing (its ``shift_labels`` entry is -100), documents may cross rank
    boundaries, the SDPA rewrites attend within documents only and the GDN rewrites reset their state
    at every document start (both GDN backends), and a packed batch cannot
    also carry padding.

    Under Head-Tail a packed batch is cut per document (every rank holds a head and a tail piece
    of every document), unless the plan has GDN in Head-Tail order, whose fragments are the two
    fixed chunks (`Plan.cuts_documents`): then it is cut like any other batch.

    Head-Tail, or a packed batch, without a user mask gets an all-ones ``attention_mask`` when
    cp > 1: transformers would read the jumps in the local position ids as packed documents of its
    own and build a ``[B, 1, S_local, S_local]`` mask; with an all-ones padding mask it passes no
    mask at all, and the rewrite reads the documents from the position ids.
    """
    check_keys(global_batch)
    plan = _as_plan(plan)
    cp_size, cp_rank, layout = _batch_layout(mesh, plan)
    bsz, seq_len = sequence_shape(global_batch)
    check_field_shapes(global_batch, bsz, seq_len)
    check_token_dtypes(global_batch)

    fields: dict[str, torch.Tensor] = {
        key: global_batch[key] for key in SEQ_DIM if global_batch.get(key) is not None
    }
    main = fields.get("input_ids", fields.get("inputs_embeds"))
    mask = fields.get("attention_mask")

    if global_batch.get("cu_seq_lens") is not None:
        if "position_ids" in fields:
            raise CPInputError("shard_batch: give a packed batch as 'position_ids' or as 'cu_seq_lens', not both")
        fields["position_ids"] = positions_from_cu_seq_lens(global_batch["cu_seq_lens"], bsz, seq_len).to(main.device)
    if "position_ids" not in fields:
        fields["position_ids"] = torch.arange(seq_len, device=main.device).unsqueeze(0).expand(bsz, -1)
    packed = is_packed(fields["position_ids"], mask)

    num_items = global_batch.get("num_items_in_batch")
    if "labels" in fields or "shift_labels" in fields:
        if "shift_labels" in fields:
            shifted = global_shift_labels(fields["shift_labels"], already_shifted=True)
        else:
            shifted = global_shift_labels(fields["labels"])
        if packed:
            shifted = end_documents(shifted, fields["position_ids"])
        fields["shift_labels"] = shifted
        # HF only computes a loss when `labels` is given; it then reads `shift_labels`.
        fields.setdefault("labels", shifted)
        if num_items is None:
            num_items = (shifted != IGNORE_INDEX).sum()

    multiple = required_multiple(layout, cp_size)
    if seq_len % multiple:
        if not pad:
            raise CPInputError(
                f"shard_batch: sequence length S={seq_len} is not a multiple of {multiple} required by the "
                f"{layout!r} layout with cp_size={cp_size}; pass pad=True to right-pad the batch at the end"
            )
        fields = _pad_fields(fields, multiple - seq_len % multiple, pad_token_id)
        seq_len = fields["position_ids"].shape[-1]

    local: dict[str, Any] = {}
    index = local_indices(seq_len, cp_size, cp_rank, layout) if cp_size > 1 else None
    order = None
    if index is not None and layout == HEAD_TAIL and packed and plan.cuts_documents():
        # each document cut into head and tail pieces (GDN in Head-Tail order keeps the two chunks)
        order = per_document_head_tail(fields["position_ids"], cp_size)
        index = order[:, cp_rank * (seq_len // cp_size):(cp_rank + 1) * (seq_len // cp_size)]
    _note_head_tail_order(layout, order is not None)
    for key, tensor in fields.items():
        if index is not None:
            tensor = _take_tokens(tensor, SEQ_DIM[key] % tensor.dim(), index.to(tensor.device))
        local[key] = tensor
    if (layout == HEAD_TAIL or packed) and cp_size > 1 and "attention_mask" not in local:
        local["attention_mask"] = torch.ones(bsz, seq_len // cp_size, dtype=torch.long, device=main.device)
    for key in PASSTHROUGH_KEYS:
        if key in global_batch and key != "num_items_in_batch":
            local[key] = global_batch[key]
    if num_items is not None:
        local["num_items_in_batch"] = num_items
    local["use_cache"] = False
    # whether any key is masked: the attention kernels' choice. Without CP the model's causal attention
    # is the only reader (adapters/hf_attention.py), and right padding, after every real query, hides
    # nothing any real query may see (`causally_unmasked_keys`)
    facts = unmasked_keys if cp_size > 1 else causally_unmasked_keys
    mark_unmasked(local["position_ids"], facts(fields["position_ids"], fields.get("attention_mask")))
    if index is not None:
        mark_layout(local["position_ids"], ShardLayout(layout, cp_size, cp_rank))
        mark_packed(local["position_ids"], packed)
    if order is not None:
        setattr(local["position_ids"], GLOBAL_POSITIONS, index.to(main.device))
        setattr(local["position_ids"], TOKEN_ORDER, order)
    return local


def _take_tokens(tensor: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """The tokens at `index` along the sequence dim `dim`: one index for every row (`[S_local]`),
    or one per row (`[1 or B, S_local]`, per-document Head-Tail; the batch dim is 0)."""
    if index.dim() == 1:
        return tensor.index_select(dim, index)
    rows = index.expand(tensor.shape[0], -1)
    rows = rows.reshape(*rows.shape, *([1] * (tensor.dim() - 2))).expand(*rows.shape, *tensor.shape[2:])
    return tensor.gather(dim, rows)


# Whether the latest Head-Tail batch `shard_batch` made in this process was cut per document, so
# that `unshard` without that batch refuses rather than restore another order.
_head_tail_per_document = False


def _note_head_tail_order(layout: str, per_document: bool) -> None:
    global _head_tail_per_document
    if layout == HEAD_TAIL:
        _head_tail_per_document = per_document


def _pad_fields(fields: dict[str, torch.Tensor], extra: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    fill = {
        "input_ids": pad_token_id,
        "inputs_embeds": 0,
        "attention_mask": 0,
        "labels": IGNORE_INDEX,
        "shift_labels": IGNORE_INDEX,
    }
    out = {}
    for key, tensor in fields.items():
        if key == "position_ids":
            out[key] = _pad_positions(tensor, extra)
        else:
            out[key] = _pad_seq(tensor, extra, fill[key], SEQ_DIM[key])
    return out


def _cp_process_group(mesh: Any):
    group = getattr(mesh, "cp_group", None)
    if group is None:
        group = mesh.cp.get_group()
    return group


def unshard(local_tensor: torch.Tensor, mesh: Any, plan: Any, *, seq_dim: int = 1,
            batch: Mapping[str, Any] | None = None) -> torch.Tensor:
    """All-gather `local_tensor` over the CP group along `seq_dim` and put it back in global order.

    Differentiable: backward sums each rank's gradient of the gathered tensor back onto the
    owning rank's slice (all-gather <-> reduce-scatter). Padding added by ``shard_batch(pad=True)``
    is not removed. At cp=1 the tensor is returned as is.

    A packed batch under Head-Tail is cut per document, so its token order depends on the batch:
    pass the local ``batch`` `shard_batch` returned for it (the batch dim must then be dim 0).
    Without it, after such a batch, `unshard` refuses (`CPInputError`) rather than guess.
    """
    cp_size, _, layout = _batch_layout(mesh, plan)
    if cp_size == 1:
        return local_tensor
    order = getattr(batch.get("position_ids"), TOKEN_ORDER, None) if batch is not None else None
    if order is not None and seq_dim % local_tensor.dim() != 1:
        raise CPInputError(f"unshard: a batch cut per document is restored along dim 1 (batch first), "
                           f"got seq_dim={seq_dim}")
    if order is None and layout == HEAD_TAIL and _head_tail_per_document and batch is None:
        raise CPInputError("unshard: the latest Head-Tail batch was packed, and cut per document, so its token order "
                           "depends on the batch: pass the local batch shard_batch returned, unshard(..., batch=local)")
    from .collectives import ALL_GATHER, WAIT

    seq_dim = seq_dim % local_tensor.dim()
    # The functional all-gather concatenates along dim 0 in rank order; its autograd twin
    # reduce-scatters the gradient back (gloo included).
    leading = local_tensor.movedim(seq_dim, 0).contiguous()
    gathered = WAIT(ALL_GATHER(leading, cp_size, _cp_process_group(mesh).group_name)).movedim(0, seq_dim)
    if order is not None:  # rank-major -> global: the rank-major slot of every global position
        return _take_tokens(gathered, seq_dim, torch.argsort(order, dim=1).to(gathered.device))
    return restore_order(gathered, cp_size, layout, seq_dim=seq_dim)
