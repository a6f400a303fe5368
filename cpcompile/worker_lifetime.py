"""A worker ends when its launcher does, however the launcher ends (issue 47, item 2).

torchrun starts each worker in a session of its own, and stops them when it is stopped by a
signal it can catch. A launcher killed outright (`kill -9`, the out-of-memory killer, its node
agent's hard stop) tells nobody: its workers used to train on, orphans, and write checkpoints into
the folder a restarted job was writing too. So each worker asks the kernel to kill it when its
parent dies: Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`, through ctypes).
Elsewhere a daemon thread watches the parent's pid instead and kills the worker within a second
of a change. SIGKILL, not SIGTERM: a worker blocked in a collective runs no Python handler, and
a killed save leaves only a `.partial` folder that no resume reads (trainer/checkpoint.py).

The parent is the launcher that started this process: `CPCOMPILE_LAUNCHER_PID` (set by
`cpcompile train --nproc-per-node`, whose torchrun agent starts the workers from its main thread;
the kernel sends the signal when the thread that forked the child exits), else the parent at the
time of the call (plain torchrun). A parent already gone by then ends the worker at once.

Standard library only: tests run this module in processes that never import torch.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

LAUNCHER_PID = "CPCOMPILE_LAUNCHER_PID"
TORCHRUN_WORKER = "TORCHELASTIC_RUN_ID"  # set in every process torchrun's agent starts
PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCH_INTERVAL_S = 1.0


def is_launched_worker() -> bool:
    """This process is a worker torchrun started (under cpcompile's launcher or not), not the
    launcher itself."""
    return TORCHRUN_WORKER in os.environ and os.environ.get(LAUNCHER_PID) != str(os.getpid())


def end_with_launcher() -> str | None:
    """In a launched worker: arrange to be killed when the launcher dies; -> the mechanism used
    ("parent-death signal" or "watchdog"), None outside a launched worker."""
    if not is_launched_worker():
        return None
    launcher = int(os.environ.get(LAUNCHER_PID, os.getppid()))
    mechanism = _parent_death_signal() if sys.platform.startswith("linux") else None
    if mechanism is None:
        mechanism = _watchdog(launcher)
    if os.getppid() != launcher:  # the launcher died before the kernel was asked
        os.kill(os.getpid(), signal.SIGKILL)
    return mechanism


def _parent_death_signal() -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(code)}")
    return "parent-death signal"


def _watchdog(launcher: int) -> str:
    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(WATCH_INTERVAL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="cpcompile-launcher-watchdog", daemon=True).start()
    return "watchdog"
