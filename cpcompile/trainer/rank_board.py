"""Where each rank of the job is, kept on the job's store, so that a rank whose collective failed
can name the ranks that did not arrive, and the collective it waited in (issue 47, item 5).

Every rank posts its step and phase when they change (`Progress.at`: one store `set`, a fraction
of a millisecond). A rank whose collective fails posts the failure with its order among the
job's failures (an atomic counter) and its kind: `timeout` (it waited its full collective
timeout) or `lost` (a peer's connection closed: the peer died, or gave up on this rank). The
first to fail reports: it waits up to `ARRIVAL_GRACE_S` for the other ranks to post theirs (live
ranks waiting in the same step time out alike, or lose the connection), and names as absent the
ranks that posted nothing (stopped, stuck, gone) and, when it timed out, the ones that failed
only by losing their peer (they came late, after it gave up), with their last positions. The
others wait for its conclusion (`wait_for_report`), so that in a launcher the first process to
end is the one with the report.

The board is a client of the job's own store with a short timeout of its own, so that the report
cannot hang on the store (under torchrun the store lives in the launcher's agent, which outlives
any worker; without torchrun, in rank 0's process). A board that cannot be reached leaves the
report without names, and says so.

The collective is the reporting rank's last one, read from PyTorch's Flight Recorder (on by
default in torch 2.13, 2000 entries, gloo included; `TORCH_FR_BUFFER_SIZE=0` turns it off, and the
report then names no collective): its name (`gloo:all_gather`), its process group's description
and its number in that group. With asynchronous collectives (FSDP2's prefetch, the CP regions'
functional ones) the last one launched is not always the one waited on; the report calls it the
last launched.
"""
from __future__ import annotations

import datetime
import itertools
import json
import time

import torch
import torch.distributed as dist

ARRIVAL_GRACE_S = 2.0  # how long a failed rank waits for the live ranks to say they arrived
REPORT_MARGIN_S = 0.5  # after the first rank concluded: its line written before this rank ends
STORE_TIMEOUT_S = 5.0  # the board's own store operations, never the job's collective timeout
_boards = itertools.count()  # one prefix per board: several runs may share a process group (tests)


class RankBoard:
    """This rank's view of the board: post its position and its arrival, read the others'."""

    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world
        self.broken: str | None = None  # why the store stopped answering, once it has

    @classmethod
    def open(cls) -> "RankBoard":
        """The board of the default process group's store (a client of its own, short timeout)."""
        board = cls(None, dist.get_rank(), dist.get_world_size())
        try:
            store = dist.distributed_c10d._get_default_store()
            store = getattr(store, "_underlying_non_prefix_store", store).clone()
            store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
            board.store = dist.PrefixStore(f"cpcompile/board/{next(_boards)}/", store)
        except Exception as exc:  # noqa: BLE001 - a store without clone (a custom one): no names, said so
            board.broken = f"{type(exc).__name__}: {exc}"
        return board

    def post(self, position: str) -> None:
        self._set(f"at/{self.rank}", position)

    def post_failure(self, kind: str) -> int | None:
        """Post this rank's failed collective (`timeout` or `lost`); -> its order among the job's
        failures (1: the first), None when the board cannot tell."""
        if self.broken is None:
            try:
                order = self.store.add("failures", 1)
                self.store.set(f"failed/{self.rank}", f"{order} {kind}")
                return order
            except Exception as exc:  # noqa: BLE001
                self.broken = f"{type(exc).__name__}: {exc}"
        return None

    def absent(self, kind: str, grace_s: float = ARRIVAL_GRACE_S) -> list[int] | None:
        """For the first rank to fail: the ranks that did not arrive (module doc), after waiting up
        to `grace_s` for the others' failures; None when the board cannot tell."""
        deadline = time.monotonic() + grace_s
        others = [rank for rank in range(self.world) if rank != self.rank]
        while self.broken is None:
            posted = {rank: self._get(f"failed/{rank}") for rank in others if self._has(f"failed/{rank}")}
            if len(posted) == len(others) or time.monotonic() >= deadline:
                late = [rank for rank, said in posted.items() if kind == "timeout" and said.endswith(" lost")]
                return None if self.broken else sorted([r for r in others if r not in posted] + late)
            time.sleep(0.05)
        return None

    def conclude(self) -> None:
        self._set("concluded", "1")

    def wait_for_report(self, limit_s: float = ARRIVAL_GRACE_S + 1.0) -> None:
        """For a rank that did not fail first: let the first conclude (and end) before this one ends."""
        deadline = time.monotonic() + limit_s
        while self.broken is None and not self._has("concluded") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(REPORT_MARGIN_S)

    def position(self, rank: int) -> str | None:
        return self._get(f"at/{rank}") if self.broken is None and self._has(f"at/{rank}") else None

    def _get(self, key: str) -> str | None:
        try:
            return self.store.get(key).decode()
        except Exception as exc:  # noqa: BLE001
            self.broken = f"{type(exc).__name__}: {exc}"
            return None

    def _set(self, key: str, value: str) -> None:
        if self.broken is None:
            try:
                self.store.set(key, value)
            except Exception as exc:  # noqa: BLE001 - the board serves the report; training goes on without it
                self.broken = f"{type(exc).__name__}: {exc}"

    def _has(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except Exception as exc:  # noqa: BLE001
            self.broken = f"{type(exc).__name__}: {exc}"
            return False


def last_collective() -> str | None:
    """This process's last collective launched, from the Flight Recorder: `gloo:all_gather in
    mesh_cp (#12 there)`; None when it recorded none."""
    try:
        trace = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, True))
    except Exception:  # noqa: BLE001 - no recorder in this build, or nothing recorded
        return None
    entries = trace.get("entries") or []
    if not entries:
        return None
    last = max(entries, key=lambda entry: entry.get("record_id", 0))
    name, description = (last.get("process_group") or ["?", ""])[:2]
    group = description if description and description != "undefined" else f"process group {name}"
    return f"{last.get('profiling_name', '?')} in {group} (#{last.get('collective_seq_id', '?')} there)"
