"""The multi-rank benchmark scripts still run on 2 gloo ranks at a tiny size: `cp_methods.py` with
every method (Hybrid skipped below 4 ranks) passing its equivalence checks, and `overlap_report.py`."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", script), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_cp_methods_smoke_on_gloo():
    res = _torchrun("cp_methods.py", "--device", "cpu", "--size", "tiny", "--local-len", "64", "--check-len", "32",
                    "--warmup", "0", "--repeat", "1")
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    table = rows[rows.index(next(r for r in rows if r.startswith("| method"))):]
    methods = {r.split("|")[1].strip(): r for r in table[1:]}
    for method in ("all_gather", "ulysses", "head_tail", "async_all_gather", "async_ulysses",
                   "gdn_ulysses_eager", "gdn_p2p_eager", "gdn_ulysses_triton", "gdn_p2p_triton"):
        assert "| yes |" in methods[method], methods.get(method, table)
    assert "skipped: Hybrid" in methods["hybrid"]


def test_overlap_report_smoke_on_gloo(tmp_path):
    out = tmp_path / "overlap.md"
    _torchrun("overlap_report.py", "--seq", "128", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--steps", "1",
              "--dump-dir", str(tmp_path / "dump"), "--out", str(out))
    rows = [line for line in out.read_text().splitlines() if line.startswith("| all_gather | async | forward")]
    assert len(rows) == 1, out.read_text()
