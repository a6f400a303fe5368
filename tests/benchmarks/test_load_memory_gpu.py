"""`benchmarks/load_memory_gpu.py` on CPU at a tiny size: ranks 0 and 3 of a dp_shard 2 x cp 2 job,
each under the fake process group, build on meta, CP rewrite, FSDP2 over 4 ranks, and load their
own slices (DCP planning locally, since the fake group cannot carry its exchange of plans); each
row's shard must equal its slices of the files. Device columns are n/a on CPU."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from script_ranks import run_script  # noqa: E402


def test_rows_are_both_ends_of_every_mesh_with_a_cp_rewrite():
    from load_memory_gpu import row_specs

    rows = [(s["n"], s["dp_shard"], s["rank"]) for s in row_specs([2, 4, 8], [1, 2])]
    assert rows == [(2, 1, 0), (2, 1, 1), (4, 1, 0), (4, 1, 3), (4, 2, 0), (4, 2, 3),
                    (8, 1, 0), (8, 1, 7), (8, 2, 0), (8, 2, 7)]  # dp_shard 2 at N=2 would leave cp 1


def test_smoke_on_cpu_loads_each_ranks_own_slices(tmp_path):
    out = tmp_path / "table.md"
    stdout = run_script("load_memory_gpu.py", "--device", "cpu", "--small", "--simulate-cp", "4", "--dp-shard", "2",
                        "--out", str(out), timeout=300)
    lines = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    head = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    rows = [dict(zip(head, (cell.strip() for cell in line.split("|")[1:-1]))) for line in lines[1:]]
    assert [(r["rank"], r["N"], r["dp_shard"], r["cp"]) for r in rows] == [("0", "4", "2", "2"), ("3", "4", "2", "2")]
    for row in rows:
        assert row["loaded = file"] == "yes", row
        assert row["load peak device MiB"] == "n/a" and row["load peak / full model"] == "n/a", row
        assert 0 < float(row["shard MiB"]) < 1, row  # a quarter of the tiny model's ~0.8 MiB
        assert all(float(v) >= 0 for v in row["host RSS peak above start MiB (build, load)"].split(",")), row
    assert out.read_text() in stdout
