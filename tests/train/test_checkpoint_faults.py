"""A checkpoint save that fails, a folder two jobs write, a metrics file after a resume (issue 47,
items 2, 4 and 6).

A full disk, a folder made read-only and one without permission cannot be made on a CI machine
without root (and as root, permissions do not bite), so the save's own write fails here on
purpose, inside DCP's writer, with the errno the filesystem would give: the failure must be one
`CheckpointError` line naming the cause (and for a full disk how much was needed), the previous
checkpoint must stay intact and be what a resume starts from, and nothing half-written may be
left. `scripts/full_disk_save.sh` makes a real small full filesystem where it can (docs/trainer.md
*Faults and resume* says what was run). One process, a tiny Qwen3: the save path is the same for
any rank count (`agreement.py` carries a rank's failure to the others)."""
from __future__ import annotations

import contextlib
import errno
import json
import os

import pytest

from dist_utils import run_distributed

QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
FAULTS = {"disk full": errno.ENOSPC, "read-only": errno.EROFS, "no permission": errno.EACCES}


def _config(folder: str) -> dict:
    return {"model": dict(QWEN3), "train": {"steps": 4, "seq_len": 16, "batch_size": 2, "lr": 1e-3},
            "checkpoint": {"folder": folder, "interval": 2}}


class _FailingFile:
    """A file that takes `room` bytes, then fails every write with `code` (ENOSPC: the disk is full
    part-way through a shard; the others at the first byte, as a read-only or forbidden folder)."""

    def __init__(self, real, code: int, room: int, path: str):
        self.real, self.code, self.room, self.path = real, code, room, path

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(self.code, os.strerror(self.code), self.path)
        self.room -= len(data)
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


@contextlib.contextmanager
def _failing_writes(code: int, step: int):
    """DCP's writer fails with `code` in every shard it writes for `step`."""
    import torch.distributed.checkpoint.filesystem as filesystem

    real = filesystem.FileSystem.create_stream
    room = 1000 if code == errno.ENOSPC else 0

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FailingFile(stream, code, room, str(path)) if f"step-{step}" in str(path) and "w" in mode else stream

    filesystem.FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = real


def _saves_that_fail(rank: int, world: int, scratch: str) -> dict:
    """Per fault: the run's message (its step-4 save fails), the folder left, the step a resume
    would start from, and the steps the resume then trains."""
    from cpcompile.cli import report
    from cpcompile.trainer import load_train_config, train
    from cpcompile.trainer.checkpoint import latest_step

    out = {}
    for name, code in FAULTS.items():
        folder = os.path.join(scratch, name.replace(" ", "_"))
        config = load_train_config(_config(folder))
        with _failing_writes(code, step=4):
            try:
                train(config, log=lambda _: None)
                message, status = "no error", 0
            except Exception as exc:  # noqa: BLE001 - the message is what is checked
                message, status = f"{type(exc).__name__}: {exc}", report("train", exc)
        left = sorted(os.listdir(folder))
        latest = latest_step(folder)
        resumed = [r["step"] for r in train(config, log=lambda _: None)]
        out[name] = (message, status, left, latest, resumed)
    return out


@pytest.fixture(scope="module")
def failed_saves(tmp_path_factory):
    return run_distributed(_saves_that_fail, 1, str(tmp_path_factory.mktemp("faults")), timeout=300)[0]


@pytest.mark.parametrize("name, words", [
    ("disk full", ["disk full writing ", "step-4.partial/__0_0.distcp", "the checkpoint needs about ", " free"]),
    ("read-only", ["read-only filesystem writing ", "step-4.partial/"]),
    ("no permission", ["permission denied writing ", "step-4.partial/"]),
])
def test_a_failed_save_is_one_line_naming_the_cause_and_keeps_the_previous_checkpoint(failed_saves, name, words):
    message, status, left, latest, resumed = failed_saves[name]
    assert message.startswith("CheckpointError: checkpoint.folder: saving step 4 failed: ") and "\n" not in message, \
        message
    assert status == 2, status
    for word in words:
        assert word in message, message
    assert "the previous checkpoint " in message and "step-2 is intact" in message, message
    assert left == ["step-2"] and latest == 2, left  # no step-4, no step-4.partial, the lock released
    assert resumed == [3, 4], resumed  # and the resume starts from step 2


def test_a_cause_lost_inside_torch_save_is_found_from_the_folder(tmp_path, monkeypatch):
    """`torch.save`'s stream writer may turn a failed write into `RuntimeError: unexpected pos`:
    with no errno left, the folder is asked (here: a filesystem reporting 1 MiB free)."""
    import collections
    import shutil

    from cpcompile.trainer import save_errors

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2 ** 30, 2 ** 30 - 2 ** 20, 2 ** 20))
    try:
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed, unexpected pos 704 vs 598")
    except RuntimeError as exc:
        line = save_errors.describe(exc, str(tmp_path / "step-8.partial"), 3 * 2 ** 30)
    assert line.startswith("disk full: the checkpoint needs about 3 GiB and ") and "1 MiB free" in line, line


def test_a_read_only_filesystem_is_found_from_the_folder(tmp_path, monkeypatch):
    from cpcompile.trainer import save_errors

    real = os.statvfs

    def read_only(path):
        result = real(path)
        return os.statvfs_result((*result[:8], result.f_flag | os.ST_RDONLY, result.f_namemax))

    monkeypatch.setattr(os, "statvfs", read_only)
    line = save_errors.describe(RuntimeError("unexpected pos 704 vs 598"), str(tmp_path / "step-8.partial"), 1)
    assert line == f"read-only filesystem: {tmp_path} cannot be written", line


def test_a_checkpoint_file_that_cannot_be_read_is_named_with_its_reason(tmp_path, monkeypatch):
    """At load every file is read for its checksum: one it may not read is named, with the reason
    (as root permissions do not bite, so the read is refused here on purpose)."""
    import builtins

    from cpcompile.trainer import checksums

    (tmp_path / "__0_0.distcp").write_bytes(b"weights")
    recorded = checksums.file_checksum(str(tmp_path / "__0_0.distcp"))
    assert checksums.mismatch(str(tmp_path), "__0_0.distcp", recorded) is None
    real = builtins.open

    def forbidden(path, *args, **kwargs):
        if str(path).endswith(".distcp"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", forbidden)
    line = checksums.mismatch(str(tmp_path), "__0_0.distcp", recorded)
    assert line == f"checkpoint {tmp_path}/__0_0.distcp cannot be read (Permission denied)", line


# --------------------------------------------------------------------------- the folder's lock


def test_a_second_job_is_refused_naming_the_first(tmp_path):
    """Held by this process (global rank 0 of a running job): the launcher's check and a second
    holder are both refused, naming the holder's pid; released, the folder is free again."""
    from cpcompile.errors import PlanError
    from cpcompile.trainer import lock

    with lock.holding(str(tmp_path), log=print):
        for attempt in (lambda: lock.check_free(str(tmp_path)), lambda: lock.holding(str(tmp_path), print).__enter__()):
            with pytest.raises(PlanError) as info:
                attempt()
            assert info.value.field == "checkpoint.folder", info.value
            assert f"is in use by another job (pid {os.getpid()} on host " in info.value.reason, info.value
    assert not os.path.exists(lock.lock_path(str(tmp_path)))
    lock.check_free(str(tmp_path))


def test_a_stale_lock_is_named_and_taken_over(tmp_path):
    """A lock file naming a job whose lock is free (its process ended without removing it: the
    kernel dropped its flock): the next job says whose it was, and holds it."""
    from cpcompile.trainer import lock

    stale = {"pid": 424242, "host": "gone", "started": "2026-12-06T01:02:03", "command": "cpcompile train a.yaml"}
    with open(lock.lock_path(str(tmp_path)), "w", encoding="utf-8") as handle:
        json.dump(stale, handle)
    lock.check_free(str(tmp_path))  # a stale lock does not stop a launch
    lines: list = []
    with lock.holding(str(tmp_path), log=lines.append):
        with open(lock.lock_path(str(tmp_path)), encoding="utf-8") as handle:
            assert json.load(handle)["pid"] == os.getpid()
    assert len(lines) == 1 and "took over the stale lock" in lines[0], lines
    assert "pid 424242 on host gone, started 2026-12-06T01:02:03" in lines[0], lines


# --------------------------------------------------------------------------- metrics after a resume


def test_a_resumed_metrics_file_holds_each_step_once(tmp_path):
    """The stopped run got to step 5 and saved step 4: the resumed run drops step 5's line (it
    redoes that step), keeps the earlier ones and lines that are no step's record."""
    from cpcompile.trainer.metrics import MetricsLog, read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 6)) + '{"note": 1}\n')
    log = MetricsLog(str(path), 6, log=lambda _: None, enabled=True, resumed_at=4)
    log.step({"step": 5, "loss": 50.0, "grad_norm": 0.0, "lr": 0.0, "tokens_per_s": 1.0, "seconds": 1.0})
    log.close()
    records = read_jsonl(str(path))
    assert [r.get("step") for r in records] == [1, 2, 3, 4, None, 5], records
    assert records[-1]["loss"] == 50.0, records
