"""A stuck rank ends the job (issue 31, item 2): every process group of `cpcompile train` gets
`train.collective_timeout_s`, and the rank left waiting says, in one line from rank 0, at which
step and in which phase the collective did not complete; the job ends within the timeout + 30 s.

Rank 1 sleeps past the timeout at one point of the run (gloo, 2 ranks): in the forward of step 2,
before a checkpoint save, or before compile's rank-agreement gather (the cp group's timeout)."""
from __future__ import annotations

import contextlib
import io
import time

import pytest
import yaml

from cp_harness import sdpa_plan
from dist_utils import run_distributed

QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
TIMEOUT_S = 3


def _stall_rank_1(where: str, stalled: list) -> None:
    """Make rank 1 sleep past the timeout at `where`; note when it started in `stalled`."""
    import cpcompile.pipeline as pipeline
    import cpcompile.trainer.checkpoint as checkpoint
    import cpcompile.trainer.loop as loop

    owner, name, call = {"forward": (loop, "token_loss_sum", 2), "checkpoint": (checkpoint, "save", 1),
                         "compile": (pipeline, "agree", 1)}[where]
    real, calls = getattr(owner, name), []

    def stalling(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            stalled.append(time.time())
            time.sleep(TIMEOUT_S + 2)
        return real(*args, **kwargs)

    setattr(owner, name, stalling)


def _main_on_rank(rank: int, world: int, path: str, where: str) -> tuple:
    from cpcompile.cli import main

    stalled: list = []
    if rank == 1:
        _stall_rank_1(where, stalled)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["train", path])
    return status, err.getvalue(), time.time(), stalled


@pytest.mark.parametrize("where, phase", [("forward", "step 2, forward"),
                                          ("checkpoint", "step 2, checkpoint save"),
                                          ("compile", "before step 1, compile")])
def test_a_stuck_rank_ends_the_job_naming_the_step_and_phase(tmp_path, where, phase):
    config = {"model": QWEN3, **sdpa_plan(2),
              "train": {"steps": 2, "seq_len": 16, "batch_size": 1, "collective_timeout_s": TIMEOUT_S},
              "checkpoint": {"folder": str(tmp_path / "ckpt"), "interval": 2}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    (status0, err0, end0, _), (status1, err1, _, stalled) = run_distributed(
        _main_on_rank, 2, str(path), where, init_pg=False, timeout=120)
    assert (status0, status1) == (2, 2) and err1 == "", (status0, status1, err1)
    assert err0.count("\n") == 1 and err0.startswith(f"cpcompile train: error: {phase}: "), err0
    assert f"train.collective_timeout_s={TIMEOUT_S} s" in err0, err0
    assert end0 - stalled[0] <= TIMEOUT_S + 30, (end0 - stalled[0], err0)  # the bound
