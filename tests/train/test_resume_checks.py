"""What a resume refuses before anything is built, in one line naming the checkpoint file and
what differs (issue 31, items 3 and 6): another LR schedule (steps, lr, warmup, schedule),
another model size or layer count, a damaged trainer.json, a missing .metadata, a truncated shard.

One small checkpoint (one process, a tiny Qwen3, stopped after step 2 of 4) is written once;
each test resumes from it, or from a damaged copy."""
from __future__ import annotations

import os
import shutil

import pytest

from dist_utils import run_distributed

QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _config(folder: str, **train) -> dict:
    return {"model": dict(QWEN3), "train": {"steps": 4, "seq_len": 16, "batch_size": 2, "lr": 1e-3, **train},
            "optimizer": {"warmup_steps": 1}, "checkpoint": {"folder": folder, "interval": 2}}


def _resume_refusals(rank: int, world: int, folder: str, edits: dict) -> dict:
    """Save step 2 of 4, then resume with each edited config; -> each refusal's message."""
    from cpcompile.trainer import load_train_config, train

    train(load_train_config(_config(folder)), log=lambda _: None, stop_after=2)
    refusals = {}
    for name, edit in edits.items():
        config = _config(folder)
        edit(config)
        try:
            train(load_train_config(config), log=lambda _: None)
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            refusals[name] = f"{type(exc).__name__}: {exc}"
    return refusals


SCHEDULE_EDITS = {
    "steps": (lambda c: c["train"].update(steps=6), ["train.steps 4 -> 6"]),
    "lr": (lambda c: c["train"].update(lr=2e-3), ["train.lr 0.001 -> 0.002"]),
    "warmup": (lambda c: c["optimizer"].update(warmup_steps=2), ["optimizer.warmup_steps 1 -> 2"]),
    "schedule": (lambda c: c["optimizer"].update(schedule="constant"), ["optimizer.schedule 'cosine' -> 'constant'"]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ckpt"))
    edits = {name: edit for name, (edit, _) in SCHEDULE_EDITS.items()}
    refusals = run_distributed(_resume_refusals, 1, folder, edits, timeout=300)[0]
    return folder, refusals


@pytest.mark.parametrize("name", sorted(SCHEDULE_EDITS))
def test_a_changed_schedule_is_refused_at_resume(saved, name):
    """Resuming with another LR schedule would run the next step at the old schedule's lr and the
    later ones at the new one's: refused, naming the checkpoint's trainer.json and the field."""
    _, refusals = saved
    message = refusals.get(name, "no error")
    assert message.startswith("CPConfigError: ") and "step-2/trainer.json" in message, message
    assert "another LR schedule" in message and "\n" not in message, message
    for words in SCHEDULE_EDITS[name][1]:
        assert words in message, message


def _damaged(saved_folder: str, tmp_path, damage) -> str:
    """A copy of the saved checkpoint folder with `damage(step folder)` done to it."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved_folder, folder)
    damage(os.path.join(folder, "step-2"))
    return folder


def _truncate(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)


DAMAGES = {
    "model size": (lambda step: None, {"hidden_size": 64},
                   ["step-2/.metadata", "another model size", "model.embed_tokens.weight is [96, 32] there and [96, 64]"]),
    "layer count": (lambda step: None, {"num_hidden_layers": 3},
                    ["step-2/.metadata", "only in this run's model (first: model.layers.2."]),
    "trainer.json": (lambda step: open(os.path.join(step, "trainer.json"), "w").write('{"step": 2, "cp_si'), {},
                     ["step-2/trainer.json is damaged"]),
    ".metadata": (lambda step: os.remove(os.path.join(step, ".metadata")), {}, ["step-2/.metadata is missing"]),
    "shard": (lambda step: _truncate(os.path.join(step, "__0_0.distcp")), {},
              ["step-2/__0_0.distcp is truncated", "bytes"]),
}


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_checkpoint_the_run_cannot_resume_is_one_line_naming_the_file(saved, tmp_path, name):
    """`check_before_building` (which `train` and `dry_run` run first) refuses each in one
    CPConfigError line naming the checkpoint file and what differs."""
    from cpcompile.errors import CPConfigError
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.startup import check_before_building

    damage, model_edit, words = DAMAGES[name]
    config = _config(_damaged(saved[0], tmp_path, damage))
    config["model"].update(model_edit)
    with pytest.raises(CPConfigError) as info:
        check_before_building(load_train_config(config))
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message


def test_the_saved_checkpoint_itself_passes(saved):
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.startup import check_before_building

    assert check_before_building(load_train_config(_config(saved[0]))) == 2
