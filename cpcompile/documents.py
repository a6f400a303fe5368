"""Packed sequences: several documents in one row, told apart by position ids restarting at 0.

The batch contract (`shard_batch`) accepts a packed batch as `position_ids` that restart at 0 at
every document (any batch size), or as `cu_seq_lens` — the cumulative document lengths
`[0, l_1, l_1 + l_2, …, S]` — with one row. Everything CP needs follows from the position ids: a
token's document starts at its global position minus its position id, which is how the SDPA
rewrites tell documents apart (`passes/sdpa/fragments.gathered_key_tags`), and a document's last
token predicts nothing (`end_documents`).

A GDN layer is called without position ids (the decoder layer keeps them), so the compiled model
hands them on itself: `shard_batch` marks whether the global batch is packed on the local
position ids (`mark_packed`, decided once, on the global batch, alike on every rank), the model's
pre-hook reads the mark (`DocumentFeed`), and the GDN regions take the position ids of a packed
batch as one more input; for one document per row they get None and run exactly as before.
"""
from __future__ import annotations

import torch

from .errors import CPInputError

IGNORE_INDEX = -100
PACKED_MARK = "_cpcompile_packed"  # set by `shard_batch` on the local position ids
# set by `shard_batch` on the local position ids of a per-document Head-Tail batch: the global
# positions of the rank's tokens `[1 or B, S_local]`, which that layout's order leaves to the data
GLOBAL_POSITIONS = "_cpcompile_global_positions"
TOKEN_ORDER = "_cpcompile_token_order"  # beside it: every rank's, `[1 or B, S]` rank-major (for `unshard`)
QUERY_POSITIONS = "cp_query_positions"  # the call argument that hands the former to a Head-Tail SDPA region
DOCUMENTS_KWARG = "cp_document_positions"  # what `DocumentFeed.hand_to_layer` adds to a layer's call
# set by `shard_batch` on the local position ids: whether every key of the global batch is real and of one
# document a row (True), not (False), or unknown (absent); handed down to a layer's call as `cp_unmasked`
UNMASKED_MARK = "_cpcompile_unmasked"
UNMASKED_KWARG = "cp_unmasked"


def mark_packed(position_ids: torch.Tensor, packed: bool) -> None:
    """Record on the local position ids whether the global batch holds packed documents."""
    setattr(position_ids, PACKED_MARK, packed)


def mark_unmasked(position_ids: torch.Tensor, unmasked: bool | None) -> None:
    """Record on the local position ids whether no key of the global batch is masked beyond causality
    (`unmasked_keys`), so that the attention regions choose their kernel without looking at the keys
    (`kernels/attention/local.py`): a read-back at every attention layer, and a graph break under
    `torch.compile`. None records nothing (unknown: the regions look)."""
    if unmasked is not None:
        setattr(position_ids, UNMASKED_MARK, unmasked)


def causally_unmasked_keys(position_ids: torch.Tensor, mask: torch.Tensor | None) -> bool | None:
    """Whether every real query of the global batch, attending causally, sees only real keys of its
    own document: one document a row (`unmasked_keys` without the mask) whose padding, if any, all
    comes after its real tokens. A right-padded key lies after every real query, so the unmasked
    causal kernel is exact at every real token; a padded query's output differs, and nothing reads
    it (its label is ignored, and no real token attends to it). For causal attention without CP
    (adapters/hf_attention.py), where the model's attention is the mark's only reader."""
    if not unmasked_keys(position_ids, None) or mask is None:
        return unmasked_keys(position_ids, None)
    real = mask.bool()
    return bool((real[:, 1:] <= real[:, :-1]).all())  # never a real token after a padded one


def unmasked_keys(position_ids: torch.Tensor, mask: torch.Tensor | None) -> bool | None:
    """Whether every key of the global batch is real and of the row's one document: no zero in the 2-D
    padding `mask`, and `[B, S]` position ids counting 0, 1, ... (the CP rewrites' document of a token
    starts at its global position minus its position id). None for other position ids (multimodal
    `[n, B, S]`): the regions then read the keys themselves. One read-back, on the global batch."""
    if position_ids.dim() != 2:
        return None
    counting = torch.arange(position_ids.shape[-1], device=position_ids.device)
    return bool((position_ids == counting).all()) and (mask is None or bool(mask.bool().all()))


class DocumentFeed:
    """The position ids of the compiled model's current call when its batch is packed (None when
    not), for regions whose own call lacks them (GDN), and the global positions of a per-document
    Head-Tail batch's tokens (None for any other), which the Head-Tail SDPA regions read off their
    own call and check against (`installed_region.InstalledRegion`). Set by the model's pre-hook on every
    call.

    Under CP only a batch marked packed by `shard_batch` is treated as packed: an unmarked one must
    hold the plain global positions of this rank's slice, which `sequence_layout.LayoutGuard` checks on every
    call of a model with such regions, so that packed documents never pass as one. Outside CP (no
    sharding, so no mark: the trainer's un-rewritten GDN layers) `marked_only=False` takes every
    call's position ids as they are, and `follow` keeps them from the model's calls.
    """

    def __init__(self, marked_only: bool = True) -> None:
        self.marked_only = marked_only
        self.positions: torch.Tensor | None = None
        self.global_positions: torch.Tensor | None = None
        self.unmasked: bool | None = None  # the call's `UNMASKED_MARK` (None: unknown)

    def update(self, position_ids: torch.Tensor | None) -> None:
        packed = position_ids is not None and (not self.marked_only or getattr(position_ids, PACKED_MARK, False))
        self.positions = position_ids if packed else None
        self.global_positions = getattr(position_ids, GLOBAL_POSITIONS, None) if packed else None
        self.unmasked = getattr(position_ids, UNMASKED_MARK, None)

    def hand_to_layer(self, _module, args, kwargs):
        """Forward pre-hook of a layer around GDN or attention regions: its call gets this model call's
        packed position ids as one more keyword, `cp_document_positions`, and whether its keys are
        unmasked, `cp_unmasked` (a plain bool: under `torch.compile` a constant of the layer's graph),
        which a Hugging Face decoder layer passes on to its GDN or attention layer with its other keywords.

        Why not the feed itself: activation checkpointing replays a layer's forward in the backward
        with the arguments the forward saved, by when the model may have run another batch, whose
        documents the feed then holds. A keyword of the layer's call is saved with the others.
        """
        return args, {**kwargs, DOCUMENTS_KWARG: self.positions, UNMASKED_KWARG: self.unmasked}

    def follow(self, model: torch.nn.Module) -> "DocumentFeed":
        """Update from the `position_ids` keyword of every call of `model` (a forward pre-hook)."""
        model.register_forward_pre_hook(lambda _module, _args, kwargs: self.update(kwargs.get("position_ids")),
                                        with_kwargs=True)
        return self


def per_document_head_tail(position_ids: torch.Tensor, cp_size: int) -> torch.Tensor:
    """`[R, S]` global token indices of each row of packed `position_ids [R, S]` in rank-major order
    (rank 0's S/cp tokens, then rank 1's, ...), each rank's in global order: per-document Head-Tail.

    Every document is cut into 2·cp pieces, and piece j goes to rank j (j < cp) or 2·cp−1−j, so
    every rank holds an early and a late piece of every document and does the same causal work on
    it. Piece lengths differ by at most one: a document's n mod 2·cp extra tokens go to the next
    slots of one counter running over the whole row, so each slot gets the same number of extras
    and every rank the same S/cp tokens (S is a multiple of 2·cp). One document is plain Head-Tail.
    """
    rows = [_head_tail_row(row, cp_size) for row in position_ids.reshape(-1, position_ids.shape[-1])]
    return torch.stack(rows)


def _head_tail_row(positions: torch.Tensor, cp_size: int) -> torch.Tensor:
    pieces, length = 2 * cp_size, positions.numel()
    starts = positions == 0
    document = starts.cumsum(0) - 1                                   # [S]: each token's document
    first = starts.nonzero().flatten()
    lengths = torch.diff(first, append=first.new_tensor([length]))
    base, rest = lengths // pieces, lengths % pieces
    first_extra = (rest.cumsum(0) - rest) % pieces                    # the counter where each document's extras start
    slots = torch.arange(pieces, device=positions.device)
    extra = (slots[None, :] - first_extra[:, None]) % pieces < rest[:, None]
    piece_ends = (base[:, None] + extra.long()).cumsum(1)            # [D, 2cp]: within the document
    piece = (positions[:, None] >= piece_ends[document]).sum(1)       # [S]: each token's piece
    owner = torch.where(piece < cp_size, piece, pieces - 1 - piece)
    if not bool((torch.bincount(owner, minlength=cp_size) == length // cp_size).all()):
        raise CPInputError(f"shard_batch: per-document Head-Tail could not give {cp_size} ranks {length // cp_size} "
                           f"tokens each (sequence length {length} must be a multiple of {pieces})")
    return torch.sort(owner, stable=True).indices


def positions_from_cu_seq_lens(cu_seq_lens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """`[1, S]` position ids restarting at each document start of `cu_seq_lens`."""
    starts = starts_from_cu_seq_lens(cu_seq_lens, batch, seq_len, "shard_batch: 'cu_seq_lens'")
    return positions_from_starts(starts).unsqueeze(0)


def starts_from_cu_seq_lens(cu_seq_lens: torch.Tensor, batch: int, seq_len: int, caller: str) -> torch.Tensor:
    """`[S]` bool: the document starts of `cu_seq_lens`, checked to describe one row of `seq_len`."""
    bounds = torch.as_tensor(cu_seq_lens).flatten().long()
    if batch != 1:
        raise CPInputError(f"{caller} describes one packed row, but the batch has {batch} rows; "
                           "pass position_ids restarting at 0 at each document instead")
    if bounds.numel() < 2 or bounds[0] != 0 or bounds[-1] != seq_len or bool((bounds[1:] <= bounds[:-1]).any()):
        raise CPInputError(f"{caller} must rise strictly from 0 to the sequence length {seq_len}, "
                           f"got {bounds.tolist()[:8]}{'...' if bounds.numel() > 8 else ''}")
    starts = torch.zeros(seq_len, dtype=torch.bool, device=bounds.device)
    starts[bounds[:-1]] = True
    return starts


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document, from a `[S]` bool of document starts (`starts[0]` set)."""
    index = torch.arange(starts.numel(), device=starts.device)
    return index - torch.where(starts, index, 0).cummax(0).values


def is_packed(position_ids: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the rows hold several documents; refuse position ids that are neither one run of
    consecutive numbers nor runs restarting at 0. Cheap: O(B·S), on the global batch.

    Only consecutive *real* tokens are compared (padding may carry any position value), and
    multimodal-rope `[n, B, S]` ids are not checked (their steps are not 1 across image tokens).
    """
    if position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return False
    step = position_ids[:, 1:] - position_ids[:, :-1]
    restart = position_ids[:, 1:] == 0
    ignored = ~(mask[:, 1:].bool() & mask[:, :-1].bool()) if mask is not None else torch.zeros_like(restart)
    if not bool(((step == 1) | restart | ignored).all()):
        raise CPInputError("shard_batch: 'position_ids' must increase by 1 between consecutive tokens, or restart "
                           "at 0 where a packed document starts")
    packed = bool((restart & ~ignored).any())
    if packed and mask is not None and not bool(mask.bool().all()):
        raise CPInputError("shard_batch: a packed batch cannot also carry padding (attention_mask with zeros); "
                           "pack the padding as a document of its own, with labels -100")
    if packed and not bool((position_ids[:, 0] == 0).all()):
        raise CPInputError("shard_batch: a packed row must start a document (position id 0) at its first token")
    return packed


def end_documents(shifted_labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets with the last token of every document predicting nothing (-100): its
    successor starts the next document."""
    ends = torch.zeros_like(shifted_labels, dtype=torch.bool)
    ends[:, :-1] = (position_ids[..., 1:] == 0).expand_as(ends[:, :-1])
    return shifted_labels.masked_fill(ends, IGNORE_INDEX)
