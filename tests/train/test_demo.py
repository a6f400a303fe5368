"""The demo (`examples/demo_all_gather.py`, what `bash scripts/demo.sh` runs) holds a tolerance:
PASS and status 0 within it, one FAIL line and status 1 beyond it; and its closing hint runs as
printed (issue 12, items 9-10). Two ranks here; the demo script runs four."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _demo(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "demo_all_gather.py"), "--seq-len", "32", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def test_the_demo_passes_and_its_hint_works(tmp_path):
    res = _demo(tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "PASS: logits, loss and every gradient within 1e-05 relative of CP=1" in res.stdout, res.stdout
    (hint,) = [line for line in res.stdout.splitlines() if line.startswith("inspect it: ")]
    shown = subprocess.run(shlex.split(hint[len("inspect it: "):]), capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT})
    assert shown.returncode == 0 and "all_gather" in shown.stdout, hint + "\n" + shown.stderr[-2000:]


def test_the_demo_fails_loudly_beyond_its_tolerance(tmp_path):
    res = _demo(tmp_path, "--rtol", "1e-12")  # CP=2 gradients differ from CP=1 by ~1e-7 (summation order)
    assert res.returncode != 0, res.stdout[-2000:]
    fails = [line for line in res.stderr.splitlines() if line.startswith("FAIL: ")]
    assert len(fails) == 1 and "> 1e-12" in fails[0], res.stderr[-3000:]
