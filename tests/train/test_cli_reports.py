"""What `cpcompile train` tells a user (issue 12, items 9-11): an error is one line from rank 0
naming its field, `--debug` keeps the traceback, a verify run that misses its tolerance says FAIL
and exits non-zero, and a missing transformers names the extra that brings it; and the README's
own launch, `python -m cpcompile train --nproc-per-node 2 CONFIG`, keeps that contract (issue 31,
item 7): one line, exit status 2, whether the launcher or a worker finds the error."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
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
    import cpcompile.trainer.step as step

    if break_gradient_sum:  # a CP bug on purpose: only rank 0's share of the loss reaches the gradient
        real = step.global_mean_loss

        def rank_0_only(local_sum, tokens, mesh):
            loss = real(local_sum, tokens, mesh)
            return loss if rank == 0 else loss * 0 + loss.detach()

        step.global_mean_loss = rank_0_only
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


@pytest.mark.parametrize("content", ['{"regions": [{"fqn": "x"', '{"regions": 3}', '[1, 2]', "\udcff"],
                         ids=["cut", "wrong-type", "not-a-summary", "not-utf8"])
def test_inspect_of_a_damaged_summary_is_one_line(tmp_path, capsys, content):
    from cpcompile.cli import main

    (tmp_path / "summary.json").write_text(content, errors="surrogateescape")
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cpcompile inspect: error: ") and "summary.json is damaged" in err, err


def test_inspect_of_a_missing_folder_is_one_line(tmp_path, capsys):
    from cpcompile.cli import main

    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cpcompile inspect: error: ") and "nowhere" in err, err


README_TRAIN = ["-m", "cpcompile", "train", "--nproc-per-node", "2"]  # the README's launch, after .venv/bin/python
EXAMPLE = os.path.join("examples", "train_qwen3_5_p2p.yaml")


def _readme_launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.run([sys.executable, *README_TRAIN, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)


def test_the_readme_launch_says_a_config_error_in_one_line():
    """Found by the launcher, before any worker starts."""
    res = _readme_launch(EXAMPLE, "--steps", "0")
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr == "cpcompile train: error: train.steps: must be an integer >= 1, got 0\n", res.stderr[-3000:]


def test_the_readme_launch_says_a_worker_error_in_one_line(tmp_path):
    """Found by the workers (the dump folder is made by each rank as it builds): rank 0's line is
    all, and the launcher exits with the workers' status."""
    (tmp_path / "file").write_text("")
    config = yaml.safe_load(open(os.path.join(ROOT, EXAMPLE), encoding="utf-8"))
    config["train"]["dump_dir"] = str(tmp_path / "file")
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    res = _readme_launch(str(path))
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("cpcompile train: error: train.dump_dir: "), \
        res.stderr[-3000:]


def test_nproc_per_node_must_be_the_mesh_size():
    res = _readme_launch(EXAMPLE, "--nproc-per-node", "3")
    assert res.returncode == 2 and res.stderr.startswith("cpcompile train: error: --nproc-per-node: is 3"), res.stderr
