"""`benchmarks/hf_trainer_gpu.py` on CPU at a tiny size: every row (the HF Trainer and TRL's SFTTrainer
with cpcompile's two lines, and cpcompile's trainer, each rank 0 of CP=2 under the fake process group)
produces numbers for rank 0's half of the sequence. No speed or memory claim here (the GPU run makes those)."""
from __future__ import annotations

from script_ranks import run_script


def test_every_row_produces_numbers(tmp_path):
    out = tmp_path / "result.md"
    run_script("hf_trainer_gpu.py", "--small", "--device", "cpu", "--seq-len", "64", "--warmup", "1", "--steps", "1",
               "--max-seconds", "500", "--rows", "hf_trainer,sft_trainer,cpcompile_trainer", "--out", str(out))
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                           for line in out.read_text().splitlines()[4:])}
    assert sorted(rows) == ["cpcompile_trainer", "hf_trainer", "sft_trainer"], out.read_text()
    for name, parallel in (("hf_trainer", "DistributedDataParallel"), ("sft_trainer", "DistributedDataParallel"),
                           ("cpcompile_trainer", "FSDP2")):
        row = rows[name]
        assert row[1:4] == [parallel, "128 x 64", "1/1"], row  # rank 0 ran its 64 of the 128 tokens
        assert float(row[4]) > 0 and float(row[5]) > 0 and float(row[7]) > 0, row
