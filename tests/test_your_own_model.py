"""The README's "Your own model" is a whole program that runs: the README's block is
examples/your_own_model.py, and the file, launched as the README says (torchrun, 2 CPU processes),
matches one process and writes one dump folder per rank."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "your_own_model.py"


def test_the_readme_shows_the_example_file_whole():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert EXAMPLE.read_text() in blocks, "README.md's 'Your own model' block is not examples/your_own_model.py"


def test_the_example_runs_as_the_readme_launches_it(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLE)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    (line,) = [line for line in res.stdout.splitlines() if line.startswith("CP=2 against one process")]
    assert float(line.rsplit(" ", 1)[1]) < 1e-10, line
    assert sorted(p.name for p in (tmp_path / "cp_dump").iterdir()) == ["rank0", "rank1"]
