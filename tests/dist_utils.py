"""Run a function on N local gloo ranks from a test, with exceptions brought back to the test.

    from dist_utils import run_distributed

    def _body(rank, world_size, scale):          # module-level: it is pickled to the children
        ...
        return something_picklable               # collected per rank

    results = run_distributed(_body, 4, 2.0)     # [result of rank 0, ..., result of rank 3]

Each rank runs in its own process with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set
(so `env://` and `build_mesh` work), the default gloo group initialised (unless `init_pg=False`)
and destroyed afterwards, and one intra-op thread (the CI box has 2 cores).

Start method: `fork` by default, because a spawned rank spends ~5 s importing torch on the
2-core CI box while a forked one starts in milliseconds. Forking is only safe with one intra-op
thread per rank (libgomp hangs in a forked child that opens a parallel region), so
`threads > 1`, a CUDA context in the parent, or a default process group already initialised
in the parent switch to `spawn`; `start_method="spawn"` forces it. Under `spawn`, `fn` and
`args` must be picklable and `fn` importable (a module-level function of the test module).
If any rank raises, `DistributedTestError` lists every failing rank with its traceback; the
other ranks are stopped shortly after instead of waiting for a collective timeout. A run that
exceeds `timeout` seconds is killed and reported with the ranks that had not finished.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import random
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

# Once a rank has failed, how long the others get to report before they are killed.
_GRACE_AFTER_FAILURE_S = 3.0
_PORT_IN_USE_MARKERS = ("address already in use", "eaddrinuse", "errno 98")
# A gloo TCP pair dropped under a rank: seen once in ~12 full runs on the 2-core box (4 ranks of
# test_sdpa_tp_cp: one rank aborted inside gloo, the others lost their connection to it; not
# reproduced in 50 runs of that file alone). When every failing rank failed that way the run is
# repeated, with a line on stderr; a rank that raised anything else (an assertion) never is.
_TRANSPORT_MARKERS = ("connection reset by peer", "connection closed by peer", "exited with code -6 without")


class DistributedTestError(AssertionError):
    """One or more ranks failed. `errors` maps rank -> traceback text, `exceptions` rank -> exception
    (when it could be pickled back)."""

    def __init__(self, message: str, errors: dict[int, str], exceptions: dict[int, BaseException]):
        super().__init__(message)
        self.errors = errors
        self.exceptions = exceptions


def free_port() -> int:
    """A free port below the kernel's ephemeral range. Rank 0 binds it only after the other ranks
    have started connecting; a port from the ephemeral range (what binding port 0 gives) can be
    picked meanwhile as a connecting socket's own source port, and a client connected to itself
    hangs its job: the likely cause of the one hang seen (all 4 ranks of test_four_gloo_ranks timed
    out, once in ~18 suite runs)."""
    low = _ephemeral_range_start()
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 10000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"dist_utils: no free port in [{max(1024, low - 10000)}, {low})")


def _ephemeral_range_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    init_pg: bool = True,
    backend: str = "gloo",
    threads: int = 1,
    env: dict[str, str] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` processes; return the per-rank results.

    Results must be picklable. `env` adds environment variables to every rank; `start_method`
    is "fork", "spawn" or None (choose, see the module doc). The port is chosen free; if rank 0
    still loses the race for it, or a gloo connection drops (`_TRANSPORT_MARKERS`), the run is
    retried (up to 3 times) on a new port.
    """
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout, init_pg, backend, threads, env or {},
                             _start_method(start_method, threads))
        except DistributedTestError as exc:
            texts = [text.lower() for text in exc.errors.values()]
            port_race = any(m in text for text in texts for m in _PORT_IN_USE_MARKERS)
            transport = all(any(m in text for m in _TRANSPORT_MARKERS) for text in texts)
            if not (port_race or transport) or attempt == 2:
                raise
            print(f"dist_utils: {getattr(fn, '__name__', fn)} lost its port or a gloo connection; run again",
                  file=sys.stderr)
    raise AssertionError("unreachable")


def _release_cached_gpu_memory() -> None:
    """Give the parent's cached CUDA blocks back before ranks start on the same GPU. The caching
    allocator keeps what earlier tests in this process freed (the GPU kernel tests reach 288K tokens);
    after them a spawned rank ran out of memory copying its first small batch (H100, 2026-12-07)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _start_method(requested: str | None, threads: int) -> str:
    if requested is not None:
        if requested == "fork" and threads != 1:
            raise ValueError("start_method='fork' needs threads=1 (libgomp is not fork-safe)")
        return requested
    import torch
    import torch.distributed as dist

    fork_ok = (
        "fork" in mp.get_all_start_methods()
        and threads == 1
        and not torch.cuda.is_initialized()
        and not (dist.is_available() and dist.is_initialized())
    )
    return "fork" if fork_ok else "spawn"


def _run_once(fn, world_size, args, timeout, init_pg, backend, threads, env, start_method) -> list[Any]:
    _release_cached_gpu_memory()
    ctx = mp.get_context(start_method)
    reports = ctx.Queue()
    base_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        **env,
    }
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, args, reports, base_env, timeout, init_pg, backend, threads),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        results, errors, exceptions = _collect(procs, reports, world_size, timeout)
    finally:
        _stop(procs)
        reports.close()
    if errors:
        parts = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
        raise DistributedTestError(
            f"{len(errors)} of {world_size} ranks failed in {getattr(fn, '__name__', fn)}:\n" + "\n".join(parts),
            errors,
            exceptions,
        )
    return [results[r] for r in range(world_size)]


def _collect(procs, reports, world_size, timeout):
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    exceptions: dict[int, BaseException] = {}
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while len(results) + len(errors) < world_size:
        now = time.monotonic()
        if now > deadline:
            for r in range(world_size):
                if r not in results and r not in errors:
                    errors[r] = f"timed out after {timeout:.0f} s (no result; possibly stuck in a collective)"
            break
        if first_failure is not None and now - first_failure > _GRACE_AFTER_FAILURE_S:
            for r in range(world_size):
                if r not in results and r not in errors:
                    errors[r] = "stopped after another rank failed"
            break
        try:
            rank, ok, payload, audits = reports.get(timeout=0.1)
        except queue.Empty:
            # A rank that died without reporting (segfault, os._exit, killed for memory).
            for r, p in enumerate(procs):
                if r not in results and r not in errors and p.exitcode is not None:
                    # Its report may still be in the pipe: look once more before declaring it lost.
                    _drain(reports, results, errors, exceptions)
                    if r not in results and r not in errors:
                        errors[r] = f"process exited with code {p.exitcode} without reporting a result"
                        first_failure = first_failure or time.monotonic()
            continue
        _record(rank, ok, payload, results, errors, exceptions)
        _keep_length_audits(audits)
        if not ok and first_failure is None:
            first_failure = time.monotonic()
    return results, errors, exceptions


def _drain(reports, results, errors, exceptions) -> None:
    while True:
        try:
            rank, ok, payload, audits = reports.get(timeout=0.2)
        except queue.Empty:
            return
        _record(rank, ok, payload, results, errors, exceptions)
        _keep_length_audits(audits)


def _record(rank, ok, payload, results, errors, exceptions) -> None:
    if ok:
        results[rank] = pickle.loads(payload)
        return
    text, exc_bytes = payload
    errors[rank] = text
    if exc_bytes is not None:
        try:
            exceptions[rank] = pickle.loads(exc_bytes)
        except Exception:  # an exception class that cannot be rebuilt: the text is enough
            pass


# The local-length audit's findings (cpcompile.installed_region.LENGTH_AUDITS) are cached per process
# and keyed so that a finding holds for every module and call alike: ranks send the ones they added
# back, and the test process keeps them, so later forked ranks inherit them instead of tracing the
# same region again (~0.7 s of CPU per rank and region kind on the CI box), as one long-lived process
# would. Findings whose key or value cannot be pickled (a class local to a test) stay in their rank.
def _length_audits():
    module = sys.modules.get("cpcompile.installed_region")
    return module.LENGTH_AUDITS if module is not None else {}


def _new_length_audits(known: set) -> list[bytes]:
    found = []
    for key, reads in list(_length_audits().items()):
        if key not in known:
            try:
                found.append(pickle.dumps((key, reads)))
            except Exception:  # noqa: BLE001 - not picklable: the next rank audits it again
                pass
    return found


def _keep_length_audits(found: list[bytes]) -> None:
    module = sys.modules.get("cpcompile.installed_region")
    for item in found if module is not None else ():
        try:
            key, reads = pickle.loads(item)
        except Exception:  # noqa: BLE001 - a class the test process cannot import
            continue
        module.LENGTH_AUDITS[key] = reads
        module.LENGTH_AUDITS.move_to_end(key)
        if len(module.LENGTH_AUDITS) > module.LENGTH_AUDITS_KEPT:
            module.LENGTH_AUDITS.popitem(last=False)


def _stop(procs) -> None:
    # Ranks that reported exit at once (os._exit); the rest are stuck or were told to stop.
    deadline = time.monotonic() + 1.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()


def _rank_main(fn, rank, world_size, args, reports, base_env, timeout, init_pg, backend, threads):
    os.environ.update(base_env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    audits_known = set(_length_audits())
    try:
        if init_pg:
            dist.init_process_group(
                backend, rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        result = fn(rank, world_size, *args)
        reports.put((rank, True, pickle.dumps(result), _new_length_audits(audits_known)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the test
        text = traceback.format_exc()
        try:
            exc_bytes = pickle.dumps(exc)
            pickle.loads(exc_bytes)
        except Exception:
            exc_bytes = None
        reports.put((rank, False, (text, exc_bytes), _new_length_audits(audits_known)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    # Flush the report, then skip interpreter teardown: with torch imported it idles ~2 s per
    # process, which is most of a small test's run time.
    reports.close()
    reports.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
