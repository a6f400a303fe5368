"""benchmarks/gdn_p2p_timeline.py: the State-P2P executor's message order as the script reads it off a
profiler trace (CPU interpreter run, a middle rank of a fake 3-rank group), and its in-flight sum."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gdn_p2p_timeline  # noqa: E402


def test_middle_rank_order_on_the_interpreter(tmp_path):
    """Forward: the receive is posted before the local summary and waited only in the chain; the
    send leaves before the output. Backward likewise around the state-gradient summary and finish."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gdn_p2p_timeline.py"), "--smoke",
                          "--dump-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "**forward:** R P local_summary P chain W S P output W" in res.stdout, res.stdout
    assert "**backward:** P local_summary R P chain W S P finish W" in res.stdout, res.stdout


def test_compute_while_receiving():
    items = [("R",), ("P", "local_summary"), ("K", "a", 30.0), ("K", "b", 10.0), ("P", "chain"), ("W",), ("S",),
             ("K", "c", 5.0), ("W",)]
    out = gdn_p2p_timeline.summarize_p2p(items)
    assert out["sequence"] == "R P local_summary [2 kernels, 0.04 ms] P chain W S [1 kernels, 0.01 ms] W"
    assert abs(out["while_receiving_ms"] - 0.04) < 1e-12 and abs(out["compute_ms"] - 0.045) < 1e-12
