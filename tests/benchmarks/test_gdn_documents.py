"""`benchmarks/gdn_documents.py --smoke` still runs on the CPU interpreter at a tiny size (T=64): a timing
row per (family, batch) with its packed / unpacked ratio, and every packed path equal, in float32, to
float64 cpcompile eager run on each document alone (no timing claim here; the GPU run makes those)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The core as the layer calls it, and the whole layer op (conv halo included); the API's cu_seqlens path
# has its own tests (tests/kernels/test_gdn_triton_documents.py), and each family costs seconds here.
FAMILIES = {"core_op": "core op", "layer": "GDN layer op (eager)"}


def test_smoke_times_and_checks_every_family():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gdn_documents.py"), "--smoke", "--T", "64",
           "--check-T", "64", "--docs", "20", "--families", *FAMILIES]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = res.stdout[res.stdout.rindex("# Packed GDN documents"):]  # rows print as they come, then again
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in report.splitlines() if line.startswith("| ")]
    timed = [r for r in rows if len(r) == 11 and r[0] != "method"]
    checked = [r for r in rows if len(r) == 7 and r[0] != "family"]
    for label in FAMILIES.values():
        mine = [r for r in timed if r[0].startswith(label)]
        assert [r[1].split(" (")[0] for r in mine] == ["one sequence", "1 document, packed path", "docs ~20"], mine
        assert all(float(r[-1]) > 0 for r in mine[1:]), mine  # a packed / unpacked ratio on every packed row
        checks = [r for r in checked if r[0].startswith(label)]
        assert len(checks) == 4 and all(r[-1] == "yes" for r in checks), checks
