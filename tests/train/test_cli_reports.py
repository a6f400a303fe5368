"""What `cpcompile train` tells a user (issue 12, items 9-11): an error is one line from rank 0
naming its field, `--debug` keeps the traceback, a verify run that misses its tolerance says FAIL
and exits non-zero, and a missing transformers names the extra that brings it."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import yaml

from cp_harness import sdpa_plan
from dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _config_file(tmp_path, cp: int = 2, **train) -> str:
    config = {"model": QWEN3, "train": {"steps": 2, "seq_len": 16, "batch_size": 2, "lr": 1e-2, **train},
              **sdpa_plan(cp)}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _main_on_rank(rank: int, world: int, argv: list[str], break_gradient_sum: bool):
    """`cpcompile.cli.main(argv)` on this rank: (exit status or the exception's name, stderr)."""
    import cpcompile.trainer.loop as loop

    if break_gradient_sum:  # a CP bug on purpose: only rank 0's share of the loss reaches the gradient
        real = loop.global_mean_loss

        def rank_0_only(local_sum, tokens, mesh):
            loss = real(local_sum, tokens, mesh)
            return loss if rank == 0 else loss * 0 + loss.detach()

        loop.global_mean_loss = rank_0_only
    from cpcompile.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except BaseException as exc:  # --debug: the error itself, with its traceback
            status = type(exc).__name__
    return status, err.getvalue()


def _cli_on_two_ranks(*argv: str, break_gradient_sum: bool = False) -> list[tuple]:
    return run_distributed(_main_on_rank, 2, list(argv), break_gradient_sum, init_pg=False, timeout=300)


def test_a_config_error_is_one_line_from_rank_0(tmp_path):
    (status0, err0), (status1, err1) = _cli_on_two_ranks("train", _config_file(tmp_path, steps=-1))
    assert (status0, status1) == (2, 2)
    assert err0 == "cpcompile train: error: train.steps: must be an integer >= 1, got -1\n", err0
    assert err1 == "", err1


def test_an_error_after_the_start_is_one_line_naming_the_field(tmp_path):
    (status0, err0), (status1, err1) = _cli_on_two_ranks("train", _config_file(tmp_path, cp=4, seq_len=32))
    assert (status0, status1) == (2, 2) and err1 == ""
    assert err0.count("\n") == 1 and err0.startswith("cpcompile train: error: accelerator.cp_size: is 4"), err0
    assert "torchrun --nproc-per-node 4" in err0, err0


def test_debug_keeps_the_traceback(tmp_path):
    results = _cli_on_two_ranks("train", _config_file(tmp_path, steps=-1), "--debug")
    assert [status for status, _ in results] == ["PlanError", "PlanError"], results


def test_a_verify_run_off_its_reference_fails_loudly(tmp_path):
    """The sum of the ranks' gradients left out: the second step's loss is off the unrewritten
    copy's, so every rank exits 1 and rank 0 says FAIL in one line."""
    path = _config_file(tmp_path, verify=True)
    (status0, err0), (status1, err1) = _cli_on_two_ranks("train", path, break_gradient_sum=True)
    assert (status0, status1) == (1, 1) and err1 == "", (status0, status1, err1)
    assert err0.count("\n") == 1 and err0.startswith("FAIL: train.verify: step 2: CP=2 loss"), err0
    assert "train.verify_rtol 1e-04" in err0, err0


def _plain_python(code: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def test_without_torchrun_the_cli_says_how_to_launch(tmp_path):
    path = _config_file(tmp_path)
    res = _plain_python(f"import sys; from cpcompile.cli import main; sys.exit(main(['train', {path!r}]))")
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.count("\n") == 1 and "accelerator.cp_size" in res.stderr, res.stderr[-3000:]
    assert "torchrun --nproc-per-node 2" in res.stderr, res.stderr


def test_a_missing_transformers_names_the_extra(tmp_path):
    path = _config_file(tmp_path, cp=1)
    res = _plain_python("import sys; sys.modules['transformers'] = None  # as if not installed\n"
                        f"from cpcompile.cli import main; sys.exit(main(['train', {path!r}]))")
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.count("\n") == 1 and 'pip install "cpcompile[train]"' in res.stderr, res.stderr[-3000:]


def test_inspect_of_a_missing_folder_is_one_line(tmp_path, capsys):
    from cpcompile.cli import main

    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cpcompile inspect: error: ") and "nowhere" in err, err
