"""`cpcompile train|bench --nproc-per-node N CONFIG`: cpcompile starts its own N workers on this
machine, with PyTorch's own launcher (torchrun's `torch.distributed.run.run`, standalone
rendezvous), after checking the config here, so that the error contract holds for the launch:

- a config error, or what the start-up checks find (`trainer/startup.py`: the places the run
  writes, the checkpoint it resumes), is one line from this process, exit status 2, and no worker
  starts;
- an error a worker meets is rank 0's one line (`cli.report`) and the launcher exits with that
  worker's status (2 for an error, 1 for `FAIL`), adding nothing: torchrun itself, as a
  separate command, prints its own failure report of ~40 lines and exits 1 whatever the worker said.

The workers run `python -m cpcompile` with the same arguments minus `--nproc-per-node`.
"""
from __future__ import annotations

import logging
import os
import sys

from .errors import PlanError

NPROC_FLAG = "--nproc-per-node"
# What torchrun sets in the processes it starts: a worker never launches workers of its own.
WORKER_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


def check_launch(nproc: int, world_size: int) -> None:
    """`--nproc-per-node` must be the config's mesh size, and given outside torchrun only."""
    if any(name in os.environ for name in WORKER_ENV):
        raise PlanError(NPROC_FLAG, "starts cpcompile's own workers: leave it out under torchrun")
    if nproc != world_size:
        raise PlanError(NPROC_FLAG, f"is {nproc}, but the config's mesh has {world_size} ranks: one process "
                                    f"per rank, --nproc-per-node {world_size}")


def worker_argv(argv: list[str]) -> list[str]:
    """`argv` (cpcompile's own arguments) without `--nproc-per-node N` / `--nproc-per-node=N`."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == NPROC_FLAG:
            skip = True
        elif not arg.startswith(NPROC_FLAG + "="):
            kept.append(arg)
    return kept


def run_workers(nproc: int, argv: list[str], quiet: bool = True) -> int:
    """Start `nproc` workers running `python -m cpcompile *argv`; -> their exit status (0, or the
    lowest failing rank's own status; 1 with one line when the workers died by a signal only)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(["--standalone", NPROC_FLAG, str(nproc), "--module", "cpcompile", *argv])
    if quiet:
        _quiet_launcher_logs()
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        return _status_of(exc.failures, argv[0])
    return 0


def _status_of(failures: dict, command: str) -> int:
    """A worker's own exit status (what it reported, with its line) when one exited by itself;
    else (killed by a signal) one line naming the rank and the signal."""
    exited = sorted((rank, f.exitcode) for rank, f in failures.items() if f.exitcode > 0)
    if exited:
        return exited[0][1]
    rank, failure = min(failures.items())
    print(f"cpcompile {command}: error: rank {rank} ended by {failure.signal_name()}", file=sys.stderr, flush=True)
    return 1


def _quiet_launcher_logs() -> None:
    """torchrun's agent logs a banner (OMP_NUM_THREADS) and each failed worker: the workers' own
    line is the report, so its loggers say only what is critical."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
