"""Where a rank is in the run (the step and its phase), so that a collective that fails there is
reported as one line naming both, instead of a backend traceback or a silent wait.

Every process group of a run gets `train.collective_timeout_s` (`cpcompile.build_mesh(timeout=)`:
the default group, the mesh's groups, FSDP2's and Hybrid CP's). gloo then raises in a rank that
waits longer than that, and a rank whose peer has gone raises too ("connection closed"); NCCL
errors surface as `torch.distributed.DistError` (NCCL's own watchdog may end the process first,
with its own message). `Progress.reporting()` turns those into a `CollectiveError` naming the
step and the phase, the ranks that did not arrive (or left) and the collective (rank_board.py);
`cpcompile train` prints it as one line from the first rank to conclude, and exits 2.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import CPCompileError
from ..finite import set_step
from .rank_board import RankBoard, last_collective

# What gloo says when a collective fails (it raises a plain RuntimeError): the wait ran out, or
# the peer's end of the connection went away.
TIMEOUT_MARKERS = ("timed out", "timeout")
LOST_PEER_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe")
SOURCE_LOCATION = re.compile(r"^\[[^\]]*\]\s*")  # gloo's "[.../unbound_buffer.cc:78] " prefix


class CollectiveError(CPCompileError, RuntimeError):
    """A collective failed (timed out, or a peer left the job): the message names the step and
    phase, and where the board could tell, the ranks that did not arrive and the collective.
    `reports`: this rank is the one to print it (the first rank whose collective failed)."""

    def __init__(self, message: str, reports: bool = True):
        super().__init__(message)
        self.reports = reports

    def __reduce__(self):
        return (type(self), (str(self), self.reports))


@dataclass
class Progress:
    """This rank's step (1-based; None before the first) and phase: start, compile, weights
    load, checkpoint load, forward, backward, optimizer, verify, checkpoint save, export; posted
    on the job's board once there is one (`attach_board`, after the process group exists)."""

    timeout_s: float
    step: int | None = None
    phase: str = "start"
    board: RankBoard | None = None

    def at(self, phase: str, step: int | None = None) -> None:
        self.phase = phase
        if step is not None:
            self.step = step
            set_step(step)  # what CPCOMPILE_CHECK_FINITE=1 names (finite.py)
        if self.board is not None:
            self.board.post(self.where())

    def attach_board(self) -> None:
        self.board = RankBoard.open()
        self.board.post(self.where())

    def where(self) -> str:
        return f"step {self.step}, {self.phase}" if self.step is not None else f"before step 1, {self.phase}"

    @contextlib.contextmanager
    def reporting(self):
        """Raise a failed collective inside the block as a `CollectiveError` naming where it happened."""
        try:
            yield self
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, CPCompileError) or not is_collective_failure(exc):
                raise
            raise self.collective_error(exc) from exc

    def collective_error(self, exc: BaseException) -> CollectiveError:
        """The `CollectiveError` for `exc`: the first rank to fail names who did not arrive and
        reports it; the others wait for it to conclude (rank_board.py), and report nothing."""
        kind = "lost" if _has(exc, LOST_PEER_MARKERS) else "timeout"
        order = self.board.post_failure(kind) if self.board is not None else None
        if order is None:  # no board to agree on: rank 0 says what it can
            return CollectiveError(self.describe(exc, None), reports=dist.is_initialized() and dist.get_rank() == 0)
        if order > 1:
            self.board.wait_for_report()
            return CollectiveError(self.describe(exc, None), reports=False)
        absent = self.board.absent(kind)
        self.board.conclude()
        return CollectiveError(self.describe(exc, absent), reports=True)

    def describe(self, exc: BaseException, absent: list[int] | None) -> str:
        """One line: where this rank was, who did not arrive or left (`absent`; None: not known)
        and their last positions, the collective, and gloo's or NCCL's own words."""
        said = SOURCE_LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        lost = _has(exc, LOST_PEER_MARKERS)
        collective = last_collective()
        at = f" at {collective} (this rank's last collective launched)" if collective else ""
        limit = f"train.collective_timeout_s={self.timeout_s:g} s"
        if not absent:
            unknown = ""
            if absent is None and self.board is not None and self.board.broken:
                unknown = f" (which rank: not known, the job's store did not answer: {self.board.broken})"
            elif absent is not None:
                unknown = " (every rank reached a collective: they may have called different ones)"
            if lost:
                return (f"{self.where()}: another rank left the job{at} (it failed or was stopped; its own error, if "
                        f"any, is in its output){unknown}: {said}")
            return (f"{self.where()}: a collective{at} did not complete within {limit}: a rank is stuck or far "
                    f"behind the others{unknown} ({said})")
        names = self._named(absent)
        if lost:
            return (f"{self.where()}: {names} left the job{at} (failed or was killed; its own error, if any, is in "
                    f"its output): {said}")
        return (f"{self.where()}: {names} did not arrive{at} within {limit}: stuck, stopped, or far behind the "
                f"others ({said})")

    def _named(self, ranks: list[int]) -> str:
        parts = []
        for rank in ranks:
            position = self.board.position(rank)
            parts.append(f"{rank} (its last position: {position})" if position else f"{rank} (no position posted)")
        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def is_collective_failure(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or _has(exc, TIMEOUT_MARKERS + LOST_PEER_MARKERS)


def _has(exc: BaseException, markers: tuple[str, ...]) -> bool:
    text = str(exc).lower()
    return any(marker in text for marker in markers)
