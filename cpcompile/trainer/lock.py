"""One job at a time in a checkpoint folder.

Two jobs saving into one `checkpoint.folder` (a job restarted while the old one still runs, two
configs pointing at one place) would write the same step folders at the same time and resume
from each other's steps. So a training job holds `<folder>/cpcompile.lock` from its start-up
checks to its end: global rank 0 takes an exclusive `flock` on it and writes who holds it (pid,
host, start time, command); a second job is refused in one line naming that holder (the
`--nproc-per-node` launcher asks before it starts any worker, `check_free`).

The kernel drops a `flock` when its process ends, however it ends, so a lock is never held by a
dead job. A lock file still naming a holder whose lock is free is a stale lock: the job that
wrote it ended without releasing it (killed, or its machine lost). The next job takes it over
and names the dead holder in its log. (On NFS, Linux implements `flock` with NFS byte-range locks,
so the lock holds across machines too.)
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from typing import Callable, Iterator

from ..errors import PlanError, short_repr

LOCK_FILE = "cpcompile.lock"


def lock_path(folder: str) -> str:
    return os.path.join(folder, LOCK_FILE)


@contextlib.contextmanager
def holding(folder: str, log: Callable[[str], None]) -> Iterator[None]:
    """Hold the folder's lock for the block; a held lock is a `PlanError` on `checkpoint.folder`, a
    stale one is taken over with a line through `log` naming the job that left it."""
    handle, stale = _acquire(lock_path(folder))
    try:
        if stale:
            log(f"checkpoint.folder: took over the stale lock {lock_path(folder)}, left by a job that ended without "
                f"releasing it ({describe_holder(stale)})")
        _write_holder(handle)
        yield
    finally:
        # removed while still locked, so that no other job can lock the old file after it is gone
        with contextlib.suppress(OSError):
            os.remove(lock_path(folder))
        handle.close()


def check_free(folder: str) -> None:
    """Refuse, as `holding` would, a folder another job holds; leave everything as it is."""
    path = lock_path(folder)
    if not os.path.isfile(path):
        return
    with open(path, "r", encoding="utf-8") as handle:
        if not _try_lock(handle):
            raise _held(path, _read_holder(handle))
        fcntl.flock(handle, fcntl.LOCK_UN)


def _acquire(path: str):
    """-> (the open, locked lock file, the stale holder it named or None)."""
    while True:
        handle = open(path, "a+", encoding="utf-8")
        if not _try_lock(handle):
            holder = _read_holder(handle)
            handle.close()
            raise _held(path, holder)
        try:
            same = os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle, _read_holder(handle)
        handle.close()  # the holder removed that file as we locked it: lock the one there now


def _try_lock(handle) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_holder(handle) -> dict | None:
    handle.seek(0)
    try:
        holder = json.loads(handle.read() or "null")
    except ValueError:
        return {"note": "an unreadable lock file"}
    return holder if isinstance(holder, dict) else None


def _write_holder(handle) -> None:
    holder = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(holder))
    handle.flush()


def describe_holder(holder: dict) -> str:
    if "pid" not in holder:
        return holder.get("note", "holder unknown")
    return (f"pid {holder['pid']} on host {holder.get('host', '?')}, started {holder.get('started', '?')}: "
            f"{short_repr(holder.get('command', ''))}")


def _held(path: str, holder: dict | None) -> PlanError:
    who = describe_holder(holder) if holder else "a job that has not written its name yet"
    return PlanError("checkpoint.folder", f"{os.path.dirname(path)} is in use by another job ({who}; lock file "
                                          f"{path}): two jobs saving into one folder would overwrite each other's "
                                          "steps; stop that job, or give this run another checkpoint.folder")
