"""Where a rank is in the run (the step and its phase), so that a collective that fails there is
reported as one line naming both, instead of a backend traceback or a silent wait.

Every process group of a run gets `train.collective_timeout_s` (`cpcompile.build_mesh(timeout=)`:
the default group, the mesh's groups, FSDP2's and Hybrid CP's). gloo then raises in a rank that
waits longer than that, and a rank whose peer has gone raises too ("connection closed"); NCCL
errors surface as `torch.distributed.DistError` (NCCL's own watchdog may end the process first,
with its own message). `Progress.reporting()` turns those into a `CollectiveError` naming the
step and the phase; `cpcompile train` prints it as one line from rank 0 and exits 2.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import CPCompileError
from ..finite import set_step

# What gloo says when a collective fails (it raises a plain RuntimeError): the wait ran out, or
# the peer's end of the connection went away.
TIMEOUT_MARKERS = ("timed out", "timeout")
LOST_PEER_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe")
SOURCE_LOCATION = re.compile(r"^\[[^\]]*\]\s*")  # gloo's "[.../unbound_buffer.cc:78] " prefix


class CollectiveError(CPCompileError, RuntimeError):
    """A collective failed (timed out, or a peer left the job): the message names the step and phase."""


@dataclass
class Progress:
    """This rank's step (1-based; None before the first) and phase: start, compile, weights
    load, checkpoint load, forward, backward, optimizer, verify, checkpoint save, export."""

    timeout_s: float
    step: int | None = None
    phase: str = "start"

    def at(self, phase: str, step: int | None = None) -> None:
        self.phase = phase
        if step is not None:
            self.step = step
            set_step(step)  # what CPCOMPILE_CHECK_FINITE=1 names (finite.py)

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
            raise CollectiveError(self.describe(exc)) from exc

    def describe(self, exc: BaseException) -> str:
        said = SOURCE_LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        if _has(exc, LOST_PEER_MARKERS):
            return (f"{self.where()}: another rank left the job (it failed or was stopped; its own error, if any, "
                    f"is in its output): {said}")
        return (f"{self.where()}: a collective did not complete within train.collective_timeout_s="
                f"{self.timeout_s:g} s: a rank is stuck or far behind the others ({said})")


def is_collective_failure(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or _has(exc, TIMEOUT_MARKERS + LOST_PEER_MARKERS)


def _has(exc: BaseException, markers: tuple[str, ...]) -> bool:
    text = str(exc).lower()
    return any(marker in text for marker in markers)
