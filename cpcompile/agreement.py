"""The ranks of a CP group agree before their first collective, or every one of them says why not.

Ranks that compiled different plans, or feed a region different shapes, issue collectives that do
not match: at best a hang or an abort inside the backend with an unrelated message, at worst
wrong numbers (AllGather and Head-Tail exchange the same shapes). So `compile` has the ranks
agree on the plan before its first collective, and every region on its input signature whenever
it meets one it has not agreed on — at compile and at a re-trace, which happen on every rank at
the same call, since every rank runs the same modules in the same order.

`agree` all-gathers one 64-bit digest per field over the cp group (a few bytes, one collective;
the values themselves are gathered only when they differ, to name them). It runs once per new
signature, never per step: a rank feeding a length the others have already agreed on, while
they bring a new one, is not caught here (the compiled model's per-call check is the batch
layout, `sequence_layout.LayoutGuard`).

Refusals agree too. Many checks read one rank's own data: the attention mask transformers built
for its shard, its positions, its documents. A rank that raised alone would leave the others
waiting in their next collective until the process group times out. So whatever can fail on one
rank's data (the probe forward, tracing, the passes) runs with no collective inside, and its
outcome is agreed in the same gather as the signature (`agree_on_outcome`): if any rank failed,
every rank raises the failure of the lowest failing rank, same class, same message, naming that
rank.
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import CPConfigError

# How much of a field's value a disagreement message quotes per rank; how list-valued fields join items.
QUOTE = 300
ITEM_SEPARATOR = "; "
# torch 2.13 renamed the tensor all-gather; the old name still works there, with a warning
ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def agree(mesh, what: str, fields: dict[str, str], error: type[Exception] = CPConfigError) -> None:
    """Check that every rank of `mesh`'s cp group holds the same `fields`; raise `error` on every
    rank otherwise, naming each field that differs and every rank's value.

    Every rank must call this at the same point with the same field names (they fix the size of
    what is gathered). The gathered buffer starts as this rank's own digests, so a group that
    communicates nothing (the fake process group of structure tests) agrees. `agree_on_outcome`
    with no failure: one gather, the values only when they differ.
    """
    agree_on_outcome(mesh, what, fields, None, error)


# A field a rank never reached, because an earlier step failed there: not a disagreement.
NOT_REACHED = "<not reached: an earlier step failed on this rank>"
OUTCOME = "outcome"


@dataclass
class Failure:
    """What one rank's failed step sends the others: the exception itself when it survives
    pickling (every cpcompile error does), else its class name and message."""

    kind: str
    message: str
    pickled: bytes | None

    @classmethod
    def of(cls, exc: BaseException) -> "Failure":
        try:
            pickled = pickle.dumps(exc)
            pickle.loads(pickled)
        except Exception:  # an exception that cannot travel: its name and message still can
            pickled = None
        return cls(type(exc).__name__, str(exc), pickled)

    def rebuilt(self, rank: int, size: int) -> BaseException:
        """The failure as every rank raises it: the same class and message, naming the rank."""
        exc = pickle.loads(self.pickled) if self.pickled is not None else RuntimeError(f"{self.kind}: {self.message}")
        exc.args = (f"{self.message} [cp rank {rank} of {size} found this; every rank of the cp group raises it]",)
        return exc


def agree_on_outcome(mesh, what: str, fields: dict[str, str], failure: BaseException | None,
                     error: type[Exception] = CPConfigError) -> None:
    """`agree` on `fields` and on whether this rank's step succeeded (`failure` is None) in one
    gather; then every rank raises alike, or none does.

    A field a failed rank never computed is `NOT_REACHED` there; it counts as a disagreement
    only where every rank reached it. Precedence: ranks that disagree on what every one of them
    reached raise that (`error`), since a failure then most likely comes from it; otherwise the
    failure of the lowest failing rank is raised on every rank, the failing rank's own exception
    (with its traceback) as the cause. Every rank must call this at the same point with the same
    field names. A group that communicates nothing (the fake process group) sees only its own row.
    """
    outcome = "ok" if failure is None else f"failed: {type(failure).__name__}: {failure}"
    size = mesh.cp_size
    if size == 1:
        if failure is not None:
            raise failure
        return
    everything = {**fields, OUTCOME: outcome}
    mine = torch.tensor([digest(everything[name]) for name in everything], dtype=torch.int64, device=_device(mesh))
    gathered = mine.repeat(size)
    ALL_GATHER_INTO(gathered, mine, group=mesh.cp_group)
    rows = gathered.view(size, -1).tolist()
    if all(row == rows[0] for row in rows):
        if failure is not None:  # every rank failed alike: each raises its own
            raise failure
        return
    sent = (fields, Failure.of(failure) if failure is not None else None)
    values: list = [None] * size
    dist.all_gather_object(values, sent, group=mesh.cp_group)
    reached = [name for name in fields if all(v[0][name] != NOT_REACHED for v in values)]
    differ = [name for name in reached if len({v[0][name] for v in values}) > 1]
    if differ:
        lines = [f"  {name}: {first_difference([v[0][name] for v in values])}" for name in differ]
        raise error(f"ranks of the cp group disagree on {what}:\n" + "\n".join(lines)
                    + "\nevery rank must compile the same plan and model and feed the same shapes "
                      "(each its own slice of one global batch: cpcompile.shard_batch)") from failure
    rank = next(r for r, v in enumerate(values) if v[1] is not None)
    if failure is not None and rank == mesh.cp_rank:
        failure.args = values[rank][1].rebuilt(rank, size).args
        raise failure
    raise values[rank][1].rebuilt(rank, size) from failure


def first_difference(values: list[str]) -> str:
    """Each rank's value; for a list of `; `-separated items, each rank's first item that differs."""
    items = [value.split(ITEM_SEPARATOR) for value in values]
    longest = max(len(i) for i in items)
    first = next((k for k in range(longest) if len({tuple(i[k:k + 1]) for i in items}) > 1), 0)
    quoted = "; ".join(f"rank {r}: {_quote(i[first]) if first < len(i) else '<none>'}" for r, i in enumerate(items))
    return f"(item {first + 1} of {longest}) {quoted}" if longest > 1 else quoted


def _quote(value: str) -> str:
    return value if len(value) <= QUOTE else value[:QUOTE] + " ..."


def _device(mesh) -> torch.device:
    """Where the group's collectives take tensors: NCCL and HCCL only take the current device's."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())
