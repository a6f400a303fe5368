"""What a resume refuses before anything is built, in one line naming the checkpoint file and
what differs (issue 31, items 3 and 6): another LR schedule (steps, lr, warmup, schedule),
another model size or layer count, a damaged trainer.json, a missing .metadata, a truncated shard;
and (issue 47, items 1, 3 and 6) any other setting that changes the trajectory unless
`checkpoint.allow_changes` lists it, a shard whose bytes changed after the save (its checksum),
a resumed `verify` run whose copies resume too, and the metrics file holding each step once.

One small checkpoint (one process, a tiny Qwen3, stopped after step 2 of 4) is written once;
each test resumes from it, or from a damaged copy. The runs that must train (the refusals found
only at load, the allowed changes, verify) run in the same one-process job."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from dist_utils import run_distributed

QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _config(folder: str, **train) -> dict:
    return {"model": dict(QWEN3), "train": {"steps": 4, "seq_len": 16, "batch_size": 2, "lr": 1e-3, **train},
            "optimizer": {"warmup_steps": 1}, "checkpoint": {"folder": folder, "interval": 2}}


def _resume_refusals(rank: int, world: int, folder: str, edits: dict, scratch: str) -> dict:
    """Save step 2 of 4, then resume with each edited config; -> each refusal's message, and
    (under "runs") what the runs that train say: `_load_time_refusals`, `_allowed_changes`,
    `_verified_runs`."""
    from cpcompile.trainer import load_train_config, train

    train(load_train_config(_config(folder)), log=lambda _: None, stop_after=2)
    refusals = {}
    for name, edit in edits.items():
        config = _config(folder)
        edit(config)
        refusals[name] = _outcome(config)
    refusals["runs"] = {**_load_time_refusals(folder, scratch), **_allowed_changes(folder, scratch),
                        **_verified_runs(scratch)}
    return refusals


def _outcome(config: dict, log=lambda _: None, **kwargs):
    """`train(config)`'s records, or the message it stopped with."""
    from cpcompile.trainer import load_train_config, train

    try:
        return train(load_train_config(config), log=log, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"


def _damage_in_place(path: str, count: int) -> None:
    """Overwrite `count` bytes in the middle of the file with other bytes: its size is unchanged."""
    with open(path, "r+b") as handle:
        middle = os.path.getsize(path) // 2 - count // 2
        handle.seek(middle)
        old = handle.read(count)
        handle.seek(middle)
        handle.write(bytes((byte + 1) % 256 for byte in old))


def _load_time_refusals(folder: str, scratch: str) -> dict:
    """Resume copies whose first shard had 8 bytes, or 64 KiB, changed in place after the save."""
    out = {}
    for name, count in (("8 bytes", 8), ("64 KiB", 64 * 1024)):
        copy = shutil.copytree(folder, os.path.join(scratch, name.replace(" ", "_")))
        _damage_in_place(os.path.join(copy, "step-2", "__0_0.distcp"), count)
        out[name] = _outcome(_config(copy))
    return out


def _allowed_changes(folder: str, scratch: str) -> dict:
    """Resume with seq_len and lr changed and allowed: the first line names both, and step 3 runs
    at the new schedule's rate (the rate an uninterrupted run at the new lr has at step 3)."""
    copy = shutil.copytree(folder, os.path.join(scratch, "allowed"))
    config = _config(copy, seq_len=32, lr=2e-3)
    config["checkpoint"]["allow_changes"] = ["train.seq_len", "train.lr"]
    lines: list = []
    resumed = _outcome(config, log=lines.append)
    fresh = _outcome({**_config(os.path.join(scratch, "fresh"), seq_len=32, lr=2e-3), "checkpoint": {}})
    return {"allowed_first_line": lines[0] if lines else "", "allowed_lrs": [r["lr"] for r in resumed],
            "fresh_lrs": [r["lr"] for r in fresh]}


def _verified_runs(scratch: str) -> dict:
    """`verify: true` uninterrupted, and stopped after step 3 and resumed from step 2 (the step-3
    checkpoint removed, as if the job died before saving it): every record, and the metrics file."""
    keys = ("step", "loss", "grad_norm", "lr", "reference_loss")
    whole = _outcome(_config(os.path.join(scratch, "whole"), verify=True))
    folder, metrics = os.path.join(scratch, "verified"), os.path.join(scratch, "verified.jsonl")
    config = _config(folder, verify=True, metrics_file=metrics)
    _outcome(config, stop_after=3)
    shutil.rmtree(os.path.join(folder, "step-3"))
    resumed = _outcome(config)
    with open(metrics, encoding="utf-8") as handle:
        lines = [json.loads(line) for line in handle]
    pick = (lambda records: [tuple(r[k] for k in keys) for r in records]) if isinstance(resumed, list) else repr
    return {"verified_whole": pick(whole), "verified_resumed": pick(resumed),
            "verified_metrics": [tuple(r[k] for k in keys) for r in lines]}


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
    refusals = run_distributed(_resume_refusals, 1, folder, edits, str(tmp_path_factory.mktemp("scratch")),
                               timeout=300)[0]
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


TRAJECTORY_EDITS = {
    "seq_len": (lambda c: c["train"].update(seq_len=32), "train.seq_len 16 -> 32"),
    "batch_size": (lambda c: c["train"].update(batch_size=4), "train.batch_size 2 -> 4"),
    "seed": (lambda c: c["train"].update(seed=1), "train.seed 0 -> 1"),
    "dtype": (lambda c: c["train"].update(dtype="float64"), "train.dtype 'float32' -> 'float64'"),
    "mixed_precision": (lambda c: c["train"].update(mixed_precision={"param_dtype": "bfloat16"}),
                        "train.mixed_precision None -> {'param_dtype': 'bfloat16'}"),
    "grad_clip": (lambda c: c["train"].update(grad_clip=1.0), "train.grad_clip None -> 1.0"),
    "betas": (lambda c: c["optimizer"].update(betas=[0.8, 0.99]), "optimizer.betas [0.9, 0.999] -> [0.8, 0.99]"),
    "weight_decay": (lambda c: c["optimizer"].update(weight_decay=0.1), "optimizer.weight_decay 0.01 -> 0.1"),
    "data": (lambda c: c.update(data={"packing": True}), "data.packing False -> True"),
    "model": (lambda c: c["model"].update(rms_norm_eps=1e-5), "model {"),
}


@pytest.mark.parametrize("name", sorted(TRAJECTORY_EDITS))
def test_a_setting_that_changes_the_trajectory_is_refused_at_resume(saved, name):
    """Each was a silent change of the loss curve (issue 47, item 3): refused before anything is
    built, naming trainer.json and the field's old and new value."""
    from cpcompile.errors import CPConfigError
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.startup import check_before_building

    edit, words = TRAJECTORY_EDITS[name]
    config = _config(saved[0])
    edit(config)
    with pytest.raises(CPConfigError) as info:
        check_before_building(load_train_config(config))
    message = str(info.value)
    assert "\n" not in message and "step-2/trainer.json" in message and "checkpoint.allow_changes" in message, message
    assert words in message, message


def test_allow_changes_lets_a_listed_change_through_and_the_first_line_names_it(saved):
    """seq_len and lr listed in checkpoint.allow_changes: the resume runs, its first line names
    both changes, and the steps after it run at the new schedule's rates (not the old lr the
    optimizer restored)."""
    runs = saved[1]["runs"]
    first = runs["allowed_first_line"]
    assert first.startswith("resumed from ") and "changed on purpose (checkpoint.allow_changes)" in first, first
    assert "train.seq_len 16 -> 32" in first and "train.lr 0.001 -> 0.002" in first, first
    assert runs["allowed_lrs"] == runs["fresh_lrs"][2:], runs


def test_allow_changes_names_only_settings_a_resume_checks():
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config

    config = _config("/tmp/unused")
    config["checkpoint"]["allow_changes"] = ["train.seq_len", "train.sequence_length"]
    with pytest.raises(PlanError) as info:
        load_train_config(config)
    assert info.value.field == "checkpoint.allow_changes[1]" and "train.seq_len" in info.value.reason, info.value


@pytest.mark.parametrize("name", ["8 bytes", "64 KiB"])
def test_a_shard_changed_in_place_is_refused_naming_it(saved, name):
    """Bytes changed in place keep the file's size, so only its checksum (recorded at save in
    trainer.json) tells: refused at load in one line naming the shard, instead of training on."""
    message = saved[1]["runs"][name]
    assert isinstance(message, str) and message.startswith("CPConfigError: "), message
    assert "\n" not in message and "step-2/__0_0.distcp is not the file the save wrote" in message, message
    assert "crc32" in message, message


def test_a_resumed_verify_run_equals_the_uninterrupted_one(saved):
    """verify's unrewritten copy resumes from its own saved state (weights, AdamW, scheduler):
    every step of the resumed run, its reference loss included, is the uninterrupted run's; and
    the metrics file holds each step once, the redone step 3 as the resumed run computed it."""
    runs = saved[1]["runs"]
    whole = runs["verified_whole"]
    assert isinstance(runs["verified_resumed"], list), runs["verified_resumed"]
    assert runs["verified_resumed"] == whole[2:], (runs["verified_resumed"], whole)
    assert runs["verified_metrics"] == whole, (runs["verified_metrics"], whole)


def test_a_verify_run_refuses_a_checkpoint_saved_without_verify(saved):
    from cpcompile.errors import CPConfigError
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.startup import check_before_building

    with pytest.raises(CPConfigError) as info:
        check_before_building(load_train_config(_config(saved[0], verify=True)))
    message = str(info.value)
    assert "\n" not in message and "step-2/verify-reference is missing" in message, message
