"""`cpcompile train` and `bench`: the loop's losses equal an unrewritten copy trained on the whole
batch, the config's errors name their field, and both verbs run the example config under torchrun."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from dist_utils import run_distributed
from gdn_harness import TEXT, gdn_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(cp: int, seed: int, **train) -> dict:
    return {"model": {"model_type": "qwen3_5_text", **TEXT},
            "train": {"steps": 3, "seq_len": 16 * cp, "batch_size": 2, "lr": 1e-2, "seed": seed, "verify": True,
                      **train},
            **gdn_plan(cp, "p2p", sdpa="sdpa_hf")}


def _train(rank: int, world: int, seed: int) -> list[dict]:
    from cpcompile.train import load_train_config, train

    return train(load_train_config(_config(world, seed)), log=lambda _: None)


def test_losses_follow_the_unrewritten_model():
    """Three AdamW steps (lr 1e-2, so the parameters move): every step's CP=2 loss equals the loss of
    a copy without CP trained on the whole batch — transformers' own GDN path, not ours."""
    records = run_distributed(_train, 2, random.randrange(1 << 30), timeout=300)
    for per_rank in records:
        assert [r["step"] for r in per_rank] == [1, 2, 3]
        for r in per_rank:
            assert abs(r["loss"] - r["reference_loss"]) <= 1e-5 * abs(r["reference_loss"]), per_rank
    assert records[0][-1]["loss"] == records[1][-1]["loss"]  # the global mean, the same on every rank


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["train"].update(epochs=2), "train.epochs"),
    (lambda c: c.pop("model"), "model"),
    (lambda c: c["model"].pop("model_type"), "model"),
    (lambda c: c["train"].update(dtype="float16"), "train.dtype"),
    (lambda c: c["train"].update(steps=0), "train.steps"),
    (lambda c: c["train"].update(lr="1e-3"), "train.lr"),
    (lambda c: c["accelerator"].update(dp_shard_size=2), "accelerator.dp_shard_size"),
    (lambda c: c.update(trainer={}), "trainer"),
])
def test_config_errors_name_the_field(edit, field):
    from cpcompile.errors import PlanError
    from cpcompile.train import load_train_config

    config = _config(2, 0)
    edit(config)
    with pytest.raises(PlanError) as info:
        load_train_config(config)
    assert info.value.field == field, info.value


def _cli(verb: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "cpcompile",
           verb, os.path.join(ROOT, "examples", "train_qwen3_5_p2p.yaml"), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


def test_cli_trains_the_example_under_torchrun():
    out = _cli("train", "--steps", "2")
    assert "step 2/2" in out and "CP=1 loss" in out, out


def test_cli_benches_the_example_under_torchrun():
    out = _cli("bench", "--warmup", "0", "--repeat", "1", "--full-sequence")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [r.split("|")[2].strip() for r in rows] == ["64", "64", "128"], out
    assert rows[0].startswith("| CP=2: gdn:p2p") and "sdpa:all_gather" in rows[0], out


def test_cli_reports_a_bad_config_without_a_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {model_type: qwen3_5_text}\ntrain: {steps: -1}\naccelerator: {cp_size: 2}\n")
    res = subprocess.run([sys.executable, "-m", "cpcompile", "train", str(path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "train.steps: must be an integer >= 1" in res.stderr, res.stderr
