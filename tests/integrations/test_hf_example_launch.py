"""Issue 52: the example SFT script (`examples/hf_trainer_sft.py`: TRL's `SFTTrainer` with packing plus
the two lines) launched as its users launch it, by `torchrun` and by `accelerate launch`, 2 CPU
processes: both run cp 2, print the same losses to the last bit, and write a checkpoint that
`from_pretrained` reads. (Exactness against one process is test_trl_sft.py's and test_hf_trainer.py's.)"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer_sft.py"
ARGS = ["--seq-len", "32", "--steps", "2", "--print-losses"]


def _launch(launcher: list[str], out_dir: Path) -> list[float]:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([str(bin_dir / launcher[0]), *launcher[1:], str(EXAMPLE), *ARGS, "--output-dir", str(out_dir)],
                         cwd=out_dir.parent, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    (line,) = [line for line in res.stdout.splitlines() if line.startswith("world ")]
    world, losses = re.fullmatch(r"world (\d+) losses (.*)", line).groups()
    assert world == "2", line  # two processes, not one training alone (accelerate's --cpu would)
    return [float(loss) for loss in losses.split()]


def test_torchrun_and_accelerate_launch_run_the_same_cp_2_job(tmp_path):
    from transformers import AutoModelForCausalLM

    by_torchrun = _launch(["torchrun", "--standalone", "--nproc-per-node", "2"], tmp_path / "torchrun")
    by_accelerate = _launch(["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port",
                             "0"], tmp_path / "accelerate")
    assert len(by_torchrun) == 2 and all(loss > 0 for loss in by_torchrun), by_torchrun
    assert by_accelerate == by_torchrun
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "torchrun" / "final")
    assert saved.config.model_type.startswith("qwen3_5")
