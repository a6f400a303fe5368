"""`cpcompile train|bench --nproc-per-node N CONFIG`: cpcompile starts its own N workers on this
machine, with PyTorch's own launcher (torchrun's `torch.distributed.run.run`, standalone
rendezvous), after checking the config here, so that the error contract holds for the launch:

- a config error, or what the start-up checks find (`trainer/startup.py`: the places the run
  writes, the checkpoint it resumes, another job holding the checkpoint folder), is one line from
  this process, exit status 2, and no worker starts;
- a worker that fails writes its one line and status into torchrun's error file for it
  (`TORCHELASTIC_ERROR_FILE`) and prints nothing; this process prints the line of the worker
  whose failure ended the job and exits with its status (2 for an error, 1 for `FAIL`): the
  first failure torchrun saw, not the workers it stopped afterwards; among those, a worker's own
  error before a worker killed by a signal ("rank 1 ended by SIGKILL", status 1), and that before
  a rank that only reports another's absence (a collective that timed out or lost its peer);
- a stopped job stops quickly: torchrun waits 30 s for workers it sent SIGTERM before it kills
  them, and a stopped (SIGSTOP) or wedged worker never ends by SIGTERM, so here the wait is
  `STOP_GRACE_S` (torchrun's `--shutdown-timeout` for a signal to this process, and the close
  after a worker failed, `_quick_stop`);
- SIGINT or SIGTERM to this process stops the workers (torchrun forwards it; they end without a
  traceback) and prints one line, exit status 128 + the signal's number;
- the workers end when this process does, however it ends (`worker_lifetime.py`: each worker has
  the kernel kill it when its launcher dies).

torchrun itself, as a separate command, prints its own failure report of ~40 lines and exits 1
whatever the worker said.

The workers run `python -m cpcompile` with the same arguments minus `--nproc-per-node`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time

from .errors import PlanError
from .worker_lifetime import LAUNCHER_PID, is_launched_worker

NPROC_FLAG = "--nproc-per-node"
# What torchrun sets in the processes it starts: a worker never launches workers of its own.
WORKER_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
STOP_GRACE_S = 2  # how long stopped workers get to end before they are killed
REPORT_KEY = "cpcompile"  # our part of a worker's error file


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


def run_workers(nproc: int, argv: list[str], quiet: bool = True, after_stop=None) -> int:
    """Start `nproc` workers running `python -m cpcompile *argv`; -> their exit status (0, or that
    of the worker whose failure ended the job, with its line: `_status_of`). A signal to this
    process stops them: one line (with `after_stop()`'s words, e.g. where to resume from), exit
    status 128 + its number."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(["--standalone", NPROC_FLAG, str(nproc), "--shutdown-timeout", str(STOP_GRACE_S),
                                "--module", "cpcompile", *argv])
    if quiet:
        _quiet_launcher_logs()
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers' parent: they end with it
    first_failed: dict = {}
    try:
        with _quick_stop(first_failed):
            torchrun.run(args)
    except ChildFailedError as exc:
        return _status_of(exc.failures, argv[0], first_failed.get("local_ranks"))
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        said = f"; {after_stop()}" if after_stop is not None else ""
        print(f"cpcompile {argv[0]}: interrupted by {name}: the workers were stopped{said}", file=sys.stderr,
              flush=True)
        return 128 + int(exc.sigval)
    return 0


@contextlib.contextmanager
def _quick_stop(first_failed: dict):
    """While torchrun runs: its closing of the workers waits `STOP_GRACE_S` between SIGTERM and
    SIGKILL instead of 30 s (a stopped worker ignores SIGTERM: the job would outlive its
    collective timeout by those 30 s), and the local ranks that had failed when it began closing
    are noted in `first_failed` (the ones it stops are failures too, afterwards)."""
    from torch.distributed.elastic.multiprocessing import api

    real = api.PContext.close

    def close(self, death_sig=None, timeout=30):
        first_failed.setdefault("local_ranks", set(getattr(self, "_failures", {})))
        return real(self, death_sig, min(timeout, STOP_GRACE_S))

    api.PContext.close = close
    try:
        yield
    finally:
        api.PContext.close = real


def _status_of(failures: dict, command: str, first_failed: set | None = None) -> int:
    """Print the line of the failure that ended the job; -> its exit status. Only the failures
    torchrun saw before it began stopping the others count (`first_failed`, local ranks); among
    them a worker's own error first, then a death by a signal, then a collective failure (which
    reports another rank's absence), each the earliest."""
    seen = {rank: f for rank, f in failures.items() if first_failed is None or f.local_rank in first_failed}
    seen = seen or failures
    reports = {rank: worker_report(f) for rank, f in seen.items()}
    for consequence in (False, None, True):
        if consequence is None:
            signaled = sorted(rank for rank, f in seen.items() if f.exitcode < 0)
            if signaled:
                rank = signaled[0]
                print(f"cpcompile {command}: error: rank {rank} ended by {seen[rank].signal_name()}; the other "
                      "workers were stopped", file=sys.stderr, flush=True)
                return 1
            continue
        found = sorted((r["time"], rank) for rank, r in reports.items() if r and r["consequence"] == consequence)
        if found:
            report = reports[found[0][1]]
            print(report["line"], file=sys.stderr, flush=True)
            return report["status"]
    exited = sorted((rank, f.exitcode) for rank, f in seen.items() if f.exitcode > 0)
    return exited[0][1] if exited else 1  # a worker that wrote no report (a traceback) said it itself


def write_worker_report(line: str, status: int, consequence: bool) -> bool:
    """In a worker of cpcompile's launcher: put this failure's line into torchrun's error file for
    it (the launcher prints the one that ended the job); -> False elsewhere (print it yourself)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if LAUNCHER_PID not in os.environ or not is_launched_worker() or not path:
        return False
    report = {"line": line, "status": status, "consequence": consequence, "time": time.time()}
    with open(path, "w", encoding="utf-8") as handle:  # torchrun's own format, with our part beside it
        json.dump({"message": line, "timestamp": int(report["time"]), REPORT_KEY: report}, handle)
    return True


def worker_report(failure) -> dict | None:
    """What a failed worker wrote with `write_worker_report`, from torchrun's `ProcessFailure`."""
    data = getattr(failure, "error_file_data", None)
    report = data.get(REPORT_KEY) if isinstance(data, dict) else None
    return report if isinstance(report, dict) and {"line", "status", "consequence", "time"} <= set(report) else None


def _quiet_launcher_logs() -> None:
    """torchrun's agent logs a banner (OMP_NUM_THREADS) and each failed worker: the workers' own
    line is the report, so its loggers say only what is critical."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
