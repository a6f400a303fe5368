"""One outcome on every rank for a step some ranks may fail alone.

A checkpoint's own files (a rank's RNG state, the checksums of its share, rank 0's trainer.json)
are written by one rank each: if one of them fails and the others walk on to the next collective,
they wait there until the collective timeout and then report a hang instead of the cause. So each
such step runs through `agree`: every rank runs its part, the ranks exchange how it went (one
`all_gather_object` of a short string or a small result), and every rank raises the same
`CheckpointError`, the first failed rank's line, or returns every rank's result.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from ..errors import CheckpointError


def agree(part: Callable[[], Any], describe: Callable[[BaseException], str]) -> list[Any]:
    """Run `part` on this rank; -> every rank's result (by rank), or a `CheckpointError` on every
    rank naming the lowest failed rank's cause (`describe(its exception)`). A `KeyboardInterrupt`
    is not caught: the job is stopping anyway."""
    try:
        outcome = ("ok", part())
    except Exception as exc:  # noqa: BLE001 - any failure of this rank's part is the others' business too
        outcome = ("failed", describe(exc))
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    failed = [(rank, text) for rank, (state, text) in enumerate(outcomes) if state == "failed"]
    if failed:
        rank, text = failed[0]
        where = "" if dist.get_world_size() == 1 else f" (rank {rank})"
        raise CheckpointError(f"{text}{where}")
    return [value for _, value in outcomes]
