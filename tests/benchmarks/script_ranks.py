"""Run a benchmark script as `python benchmarks/SCRIPT ARGS` (or under `torchrun --nproc-per-node N`)
would, in ranks forked from the test process (`dist_utils.run_distributed`, the default group left
to the script) instead of fresh interpreters: the script runs whole, as `__main__`, and reads the
same RANK/WORLD_SIZE/MASTER_* environment torchrun gives it; the ranks inherit the test process's
imports (torch, transformers, cpcompile, AOT autograd and export: ~5 s of CPU a fresh interpreter
spends on the 2-core CI box, and torchrun's own process and teardown besides)."""
from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys

from dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(script: str, *args: str, ranks: int = 1, timeout: float = 600.0) -> str:
    """Rank 0's stdout (the script's prints; what its own subprocesses print, it captures itself); a
    rank that raises or exits with a non-zero status fails the test with its output."""
    env = {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    return run_distributed(_as_main, ranks, script, list(args), init_pg=False, timeout=timeout, env=env)[0]


# what dist_utils sets for a rank and torchrun would: a one-process script runs as `python SCRIPT`, without them
TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _as_main(rank: int, world_size: int, script: str, args: list[str]) -> str:
    path = os.path.join(ROOT, "benchmarks", script)
    if world_size == 1:
        for name in TORCHRUN_ENV:
            os.environ.pop(name, None)
    os.chdir(ROOT)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))  # as `python SCRIPT` puts it first: its sibling modules
    out, status = io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            status = exc.code
    if status not in (0, None):
        raise AssertionError(f"{script} exited with status {status} on rank {rank}:\n{out.getvalue()[-3000:]}")
    return out.getvalue()
