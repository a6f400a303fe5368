"""A stuck rank ends the job (issue 31, item 2; issue 47, item 5): every process group of
`cpcompile train` gets `train.collective_timeout_s`, and the rank left waiting says, in one line,
at which step and in which phase the collective did not complete, which rank did not arrive (and
where that rank was last), and the collective; the job ends within the timeout + 30 s.

One rank sleeps well past the timeout at one point of the run (gloo, 2 ranks): rank 1 in the
forward of step 2, before a checkpoint save, or before compile's rank-agreement gather (the cp
group's timeout); and rank 0 in the forward, whose stall no longer silences the report (the rank
that waited, rank 1, prints it). The stuck rank wakes about when the report concludes; it is named
either way (rank_board.py: silent, or failing only by a lost peer after the others timed out)."""
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


STALL_S = TIMEOUT_S + 2


def _stall(where: str, stalled: list) -> None:
    """Make this rank sleep past the timeout at `where`; note when it started in `stalled`."""
    import cpcompile.pipeline as pipeline
    import cpcompile.trainer.checkpoint as checkpoint
    import cpcompile.trainer.step as step

    owner, name, call = {"forward": (step, "token_loss_sum", 2), "checkpoint": (checkpoint, "save", 1),
                         "compile": (pipeline, "agree", 1)}[where]
    real, calls = getattr(owner, name), []

    def stalling(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            stalled.append(time.time())
            time.sleep(STALL_S)
        return real(*args, **kwargs)

    setattr(owner, name, stalling)


def _main_on_rank(rank: int, world: int, path: str, where: str, stuck_rank: int) -> tuple:
    from cpcompile.cli import main

    stalled: list = []
    if rank == stuck_rank:
        _stall(where, stalled)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["train", path])
    return status, err.getvalue(), time.time(), stalled


@pytest.mark.parametrize("where, phase, stuck", [("forward", "step 2, forward", 1),
                                                 ("checkpoint", "step 2, checkpoint save", 1),
                                                 ("compile", "before step 1, compile", 1),
                                                 ("forward", "step 2, forward", 0)])
def test_a_stuck_rank_ends_the_job_naming_the_step_phase_and_rank(tmp_path, where, phase, stuck):
    config = {"model": QWEN3, **sdpa_plan(2),
              "train": {"steps": 2, "seq_len": 16, "batch_size": 1, "collective_timeout_s": TIMEOUT_S},
              "checkpoint": {"folder": str(tmp_path / "ckpt"), "interval": 2}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    results = run_distributed(_main_on_rank, 2, str(path), where, stuck, init_pg=False, timeout=120)
    (status, err, end, _), (status_stuck, err_stuck, _, stalled) = results[1 - stuck], results[stuck]
    assert (status, status_stuck) == (2, 2) and err_stuck == "", (status, status_stuck, err_stuck)
    assert err.count("\n") == 1 and err.startswith(f"cpcompile train: error: {phase}: "), err
    assert f"rank {stuck} (its last position: {phase}) did not arrive at gloo:" in err, err
    assert f"within train.collective_timeout_s={TIMEOUT_S} s" in err, err
    assert end - stalled[0] <= TIMEOUT_S + 30, (end - stalled[0], err)  # the bound
