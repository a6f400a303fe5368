"""Where a run writes is checked at start-up, before anything is built (issue 31, item 4): the
checkpoint folder (writable, room for one checkpoint by estimate) and the metrics file; each
failure is one line naming the field. All in this process: nothing here starts a process group."""
from __future__ import annotations

import contextlib
import io

import pytest
import yaml

QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _config(checkpoint: dict | None = None, **train) -> dict:
    config = {"model": dict(QWEN3), "train": {"steps": 2, "seq_len": 16, "batch_size": 2, **train}}
    if checkpoint is not None:
        config["checkpoint"] = checkpoint
    return config


def _refusal(config: dict):
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.startup import check_before_building

    with pytest.raises(PlanError) as info:
        check_before_building(load_train_config(config))
    return info.value


def test_a_checkpoint_folder_that_is_a_file_names_the_field(tmp_path):
    (tmp_path / "file").write_text("")
    error = _refusal(_config({"folder": str(tmp_path / "file")}))
    assert error.field == "checkpoint.folder" and "is a file" in error.reason, error


def test_a_checkpoint_folder_that_cannot_be_made_names_the_field():
    error = _refusal(_config({"folder": "/proc/cpcompile-test/ckpt"}))
    assert error.field == "checkpoint.folder" and "cannot write" in error.reason, error


def test_a_checkpoint_folder_without_room_for_one_checkpoint_names_the_field(tmp_path, monkeypatch):
    import shutil

    import cpcompile.trainer.startup as startup

    monkeypatch.setattr(startup.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    error = _refusal(_config({"folder": str(tmp_path / "ckpt")}))
    assert error.field == "checkpoint.folder" and "GiB free" in error.reason, error


@pytest.mark.parametrize("where", ["folder", "proc"])
def test_a_metrics_file_that_cannot_be_written_names_the_field(tmp_path, where):
    path = str(tmp_path) if where == "folder" else "/proc/cpcompile-test/metrics.jsonl"
    error = _refusal(_config(metrics_file=path))
    assert error.field == "train.metrics_file", error


def test_the_checks_leave_a_writable_place_as_it_was(tmp_path):
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.startup import check_before_building

    config = _config({"folder": str(tmp_path / "ckpt")}, metrics_file=str(tmp_path / "logs" / "m.jsonl"))
    assert check_before_building(load_train_config(config)) is None
    assert list((tmp_path / "ckpt").iterdir()) == [] and list((tmp_path / "logs").iterdir()) == []


def test_cpcompile_train_says_it_in_one_line_before_training(tmp_path):
    """As the issue found it: a checkpoint folder that is a file used to train step 1, then fail
    with a traceback on every rank at the first save."""
    from cpcompile.cli import main

    (tmp_path / "file").write_text("")
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(_config({"folder": str(tmp_path / "file")})))
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        assert main(["train", str(path)]) == 2
    assert err.getvalue().startswith("cpcompile train: error: checkpoint.folder: ") and err.getvalue().count("\n") == 1
    assert "step 1" not in out.getvalue(), out.getvalue()
