"""Why a checkpoint save failed, said in one line that names the cause.

What a failed save raises rarely says it: DCP gathers every rank's failure into a
`CheckpointException` (a `BaseException`, its text a traceback per rank), and a write that fails
inside `torch.save`'s stream writer often arrives as `RuntimeError: ... unexpected pos 704 vs 598`,
the OSError behind it gone. So the cause is the first OSError with an errno found anywhere in the
exception (its causes and contexts, DCP's per-rank failures); without one, the folder itself is
asked: a read-only filesystem, no permission to write, less room than the checkpoint needs.
"""
from __future__ import annotations

import errno
import os
import shutil

from torch.distributed.checkpoint.api import CheckpointException

GIB = 2.0 ** 30
# errno -> what the line calls it; the rest are named by their strerror
NAMED_CAUSES = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
ROOM_CAUSES = (errno.ENOSPC, errno.EDQUOT)


def describe(exc: BaseException, folder: str, needed_bytes: int) -> str:
    """The cause of a failed save into `folder` of a checkpoint of `needed_bytes`, in one line."""
    found = first_os_error(exc)
    if found is not None and found.errno in NAMED_CAUSES:
        return _named(found, folder, needed_bytes)
    probed = probe_folder(folder, needed_bytes)
    if probed is not None:
        return probed
    if found is not None:
        return f"{found.strerror or found} ({_where(found, folder)})"
    root = _innermost(exc)
    return f"{type(root).__name__}: {_first_line(root)}"


def load_cause(exc: BaseException) -> str:
    """Why DCP could not read a checkpoint back, in a few words: the OSError if there is one
    (a permission, a vanished file), else the innermost exception's first line (a damaged
    pickle, a size mismatch)."""
    found = first_os_error(exc)
    if found is not None:
        return f"{found.strerror or found} ({found.filename})" if found.filename else str(found.strerror or found)
    root = _innermost(exc)
    return f"{type(root).__name__}: {_first_line(root)}"


def first_os_error(exc: BaseException) -> OSError | None:
    """The first OSError carrying an errno in `exc`, its causes and contexts, and the per-rank
    failures a `CheckpointException` holds."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        if isinstance(current, CheckpointException):
            pending.extend(failure[0] if isinstance(failure, tuple) else failure
                           for _, failure in sorted(current.failures.items()))
        pending.extend((current.__cause__, current.__context__))
    return None


def probe_folder(folder: str, needed_bytes: int) -> str | None:
    """What the folder says when the exception did not: read-only, not writable, or too full."""
    existing = _nearest_existing(folder)
    if existing is None:
        return None
    try:
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return f"read-only filesystem: {existing} cannot be written"
    except OSError:
        pass
    if not os.access(existing, os.W_OK):
        return f"permission denied: {existing} cannot be written by this user"
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        return (f"disk full: the checkpoint needs about {_size(needed_bytes)} and {existing} has "
                f"{_size(free)} free")
    return None


def _named(found: OSError, folder: str, needed_bytes: int) -> str:
    cause = NAMED_CAUSES[found.errno]
    where = _where(found, folder)
    if found.errno in ROOM_CAUSES:
        existing = _nearest_existing(folder) or folder
        free = shutil.disk_usage(existing).free if os.path.exists(existing) else 0
        return (f"{cause} writing {where}: the checkpoint needs about {_size(needed_bytes)} and "
                f"{existing} has {_size(free)} free")
    return f"{cause} writing {where}"


def _where(found: OSError, folder: str) -> str:
    return str(found.filename) if found.filename else folder


def _nearest_existing(path: str) -> str | None:
    """`path`, or the closest folder above it that exists (a save may fail before it made its own)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path


def _innermost(exc: BaseException) -> BaseException:
    """The exception a wrapper (DCP's per-rank failures, a `raise ... from`) carries, else `exc`."""
    if isinstance(exc, CheckpointException) and exc.failures:
        failure = exc.failures[min(exc.failures)]
        return failure[0] if isinstance(failure, tuple) else failure
    return exc.__cause__ or exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _size(count: int) -> str:
    if count >= GIB:
        return f"{count / GIB:.3g} GiB"
    if count >= 2 ** 20:
        return f"{count / 2 ** 20:.3g} MiB"
    return f"{count / 1024:.3g} KiB"
