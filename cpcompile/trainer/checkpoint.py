"""Checkpoints with `torch.distributed.checkpoint` (DCP): `<folder>/step-<n>/`.

Saved: the model and optimizer state (`get_state_dict`, sharded DTensors as FSDP2 holds them;
DCP reshards them on load, so a run may resume with another dp_shard / dp_replicate size), the
LR scheduler, the step (which is the data position: `data.py`), each rank's RNG states
(`rng-rank<r>.pt` beside the DCP files; a rank that finds none of its own takes rank 0's), the
model's transformers config (`config.json`, for `export.py`), and with `train.verify` the states
of verify's unrewritten copies (`verify-<name>/`, DCP too), so that a resumed verified run
checks against copies that resume as well. trainer.json, written last, records the step, the
run's facts (`run_facts`: the mesh sizes and the settings `resume_settings.py` compares) and the
checksum of every other file (`checksums.py`).

A save is all or nothing: the ranks write into `step-<n>.partial/`, and rank 0 renames it to
`step-<n>` once every file and trainer.json are written, so a failed save (disk full, a
read-only folder, an interrupted job) never leaves a half-written step that a resume would take
for the latest, and the previous checkpoint stays as it was. A failure on any rank is one
`CheckpointError` on every rank naming the cause (`save_errors.py`, `agreement.py`).

A checkpoint's CP size must be the run's: another one is refused (`trainer.json` records it). So
is any change of the settings that fix the trajectory (`resume_settings.py`), unless
`checkpoint.allow_changes` names it.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..errors import CheckpointError, CPConfigError
from . import checksums, resume_checks, resume_settings, save_errors
from .agreement import agree
from .progress import is_collective_failure

STEP_FOLDER = re.compile(r"^step-(\d+)$")
META_FILE = "trainer.json"
CONFIG_FILE = "config.json"  # the model's transformers config
PARTIAL = ".partial"  # a save in progress: step-<n>.partial, renamed to step-<n> when complete
REPLACED = ".replaced"  # a step saved again (resume: false) is moved aside until the new one is in place


def step_folder(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def latest_step(folder: str | None) -> int | None:
    """The highest step with a complete checkpoint (its trainer.json written last) in `folder`."""
    if folder is None or not os.path.isdir(folder):
        return None
    steps = [int(m.group(1)) for name in os.listdir(folder) if (m := STEP_FOLDER.match(name))
             and os.path.isfile(os.path.join(folder, name, META_FILE))]
    return max(steps, default=None)


def partial_folder(folder: str, step: int) -> str:
    return step_folder(folder, step) + PARTIAL


def reference_folder(name: str) -> str:
    """Where in a step folder verify's unrewritten copy `name` is saved."""
    return f"verify-{name}"


def run_facts(config) -> dict:
    """What trainer.json records of the run besides the step: the mesh sizes, the settings a
    resume compares (`resume_settings.recorded`), and the data settings (`export` reads the
    tokenizer folder from them)."""
    accelerator = config.plan.accelerator
    facts = {name: getattr(accelerator, name) for name in ("cp_size", "dp_shard_size", "dp_replicate_size")}
    return {**facts, "settings": resume_settings.recorded(config),
            "data": {key: getattr(config.data, key) for key in ("source", "path", "text_field", "tokenizer",
                                                                 "packing")}}


def check_compatible(folder: str, step: int, config, model: torch.nn.Module | None = None) -> None:
    """Refuse, before anything is built, in one line naming the file and what differs, a
    checkpoint this run cannot resume from: a damaged trainer.json, another CP size, a missing or
    unreadable DCP index, a missing or truncated shard, another model (`model`, on the meta
    device: its tensor names and shapes; not checked without it), a missing RNG file
    (resume_checks.py), a changed setting `checkpoint.allow_changes` does not list
    (resume_settings.py), and with `train.verify` a checkpoint that holds no state of verify's
    copies. The files' checksums are checked when they are read (`load`)."""
    path = step_folder(folder, step)
    meta = resume_checks.read_trainer_json(os.path.join(path, META_FILE))
    saved, cp_size = meta["cp_size"], config.plan.accelerator.cp_size
    if saved != cp_size:
        raise CPConfigError(f"checkpoint {path} was saved with cp_size={saved} and this run has "
                            f"cp_size={cp_size}: resuming with another CP size is not supported (use "
                            "the checkpoint's cp_size, or another checkpoint.folder)")
    metadata = resume_checks.read_dcp_metadata(path)
    resume_checks.check_shard_files(path, metadata)
    if model is not None:
        resume_checks.check_model_tensors(path, metadata, model)
    resume_checks.check_rng_file(path)
    resume_settings.check(meta, config, os.path.join(path, META_FILE))
    if config.train.verify:
        for name in reference_names(config.train):
            resume_checks.check_reference_folder(path, reference_folder(name))


def reference_names(settings) -> list[str]:
    """The names of verify's unrewritten copies (`verify.build_references` builds them)."""
    return ["reference", "fp32_reference"] if settings.dtype == "bfloat16" else ["reference"]


def trainer_state(model, optimizer, scheduler) -> dict:
    """What DCP saves and loads of one trained model: its parameters, AdamW's state, the scheduler."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}


def state_bytes(state) -> int:
    """The bytes of every tensor in a (nested) state dict, whole (a DTensor counts its global size)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def save(folder: str, step: int, model, optimizer, scheduler, facts: dict, references: dict | None = None) -> str:
    """Every rank: save the states of `step` (completed steps) into `step-<n>.partial/` (the
    trainer's with DCP, each of `references` (verify's copies: name -> (model, optimizer,
    scheduler)) into its `verify-<name>/`, each rank's RNG state, rank 0 the model's config.json),
    checksum every file, then rank 0 writes trainer.json (the step, `facts`, the checksums) and
    renames the folder to `step-<n>`. -> that folder. A failure on any rank is a
    `CheckpointError` on every rank naming the cause; the partial folder is removed and the
    previous checkpoint is left as it was."""
    final, partial = step_folder(folder, step), partial_folder(folder, step)
    states = {"": trainer_state(model, optimizer, scheduler)}
    for name, (copy, copy_optimizer, copy_scheduler) in (references or {}).items():
        states[reference_folder(name)] = trainer_state(copy, copy_optimizer, copy_scheduler)
    def describe(exc: BaseException) -> str:
        # what a save writes: the last one's files when there is one (they hold the serialisation's
        # overhead, the index, the RNG states), else the tensors' bytes
        needed = max(sum(state_bytes(state) for state in states.values()), _folder_bytes(folder, latest_step(folder)))
        return save_errors.describe(exc, partial, needed)

    try:
        agree(lambda: _clear_unfinished_saves(folder) if dist.get_rank() == 0 else None, describe)
        for sub, state in states.items():
            dcp.save(state, checkpoint_id=os.path.join(partial, sub))
        agree(lambda: _write_rank_files(partial, model), describe)
        names = checksums.checkpoint_files(partial)
        shares = agree(lambda: checksums.checksums_of(
            partial, checksums.share(names, dist.get_rank(), dist.get_world_size())), describe)
        sums = dict(sorted((name, value) for share in shares for name, value in share.items()))
        meta = {"step": step, **facts, "checksums": {"algorithm": checksums.ALGORITHM, "files": sums}}
        agree(lambda: _publish(partial, final, meta) if dist.get_rank() == 0 else None, describe)
    except (Exception, CheckpointException) as exc:
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError) and is_collective_failure(exc):
            raise  # a rank stuck or gone: the run's collective report names it (progress.py)
        cause = str(exc) if isinstance(exc, CheckpointError) else describe(exc)  # the room left, before cleaning up
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"checkpoint.folder: saving step {step} failed: {cause}; "
                              f"{_what_is_left(folder)}") from None
    return final


def _folder_bytes(folder: str, step: int | None) -> int:
    """The bytes of the files of checkpoint `step` in `folder` (0 for none)."""
    if step is None:
        return 0
    path = step_folder(folder, step)
    return sum(checksums.file_size(os.path.join(path, name)) for name in checksums.checkpoint_files(path))


def _clear_unfinished_saves(folder: str) -> None:
    """Remove what saves that did not complete left (`*.partial`, `*.replaced`): this job holds
    the folder's lock (lock.py), so no other job is writing them."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if name.endswith((PARTIAL, REPLACED)) and STEP_FOLDER.match(name.rsplit(".", 1)[0]):
            shutil.rmtree(os.path.join(folder, name))


def _write_rank_files(partial: str, model) -> None:
    torch.save(_rng_state(), os.path.join(partial, f"rng-rank{dist.get_rank()}.pt"))
    if dist.get_rank() == 0:
        model.config.to_json_file(os.path.join(partial, CONFIG_FILE))


def _publish(partial: str, final: str, meta: dict) -> None:
    """Rank 0: trainer.json last, flushed to disk, then the folder renamed into place (a rename is
    atomic: a reader sees the old step, or the complete new one)."""
    path = os.path.join(partial, META_FILE)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(meta, handle, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    replaced = final + REPLACED
    if os.path.exists(final):  # the same step saved again (a run with checkpoint.resume: false)
        os.rename(final, replaced)
    os.rename(partial, final)
    _sync_folder(os.path.dirname(final))
    shutil.rmtree(replaced, ignore_errors=True)


def _sync_folder(folder: str) -> None:
    """Flush the folder's entries (the rename) to disk, where the platform allows it."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass  # some filesystems refuse fsync on a folder; the rename itself is done
    finally:
        os.close(handle)


def _what_is_left(folder: str) -> str:
    latest = latest_step(folder)
    if latest is None:
        return "no earlier checkpoint is there"
    return f"the previous checkpoint {step_folder(folder, latest)} is intact and a resume starts from it"


def load(folder: str, step: int, model, optimizer, scheduler, config=None, references: dict | None = None) -> int:
    """Every rank: restore the checkpoint of `step` (`check_compatible` first): check its files'
    checksums (each rank a share), load the model, optimizer and scheduler, with `config` put
    this run's optimizer and schedule values in place (`resume_settings.apply_to_optimizer`: the
    same values unless `checkpoint.allow_changes` let them change), the RNG state, and each of
    `references` from its `verify-<name>/`. -> the step to continue from."""
    path = step_folder(folder, step)
    with open(os.path.join(path, META_FILE), encoding="utf-8") as handle:
        meta = json.load(handle)
    check_checksums(path, meta)
    _load_state(path, model, optimizer, scheduler)
    if config is not None:
        resume_settings.apply_to_optimizer(optimizer, scheduler, config)
    for name, (copy, copy_optimizer, copy_scheduler) in (references or {}).items():
        _load_state(os.path.join(path, reference_folder(name)), copy, copy_optimizer, copy_scheduler)
    own = os.path.join(path, f"rng-rank{dist.get_rank()}.pt")
    _set_rng_state(torch.load(own if os.path.isfile(own) else os.path.join(path, "rng-rank0.pt"), weights_only=False))
    return meta["step"]


def check_checksums(path: str, meta: dict) -> None:
    """Every file trainer.json records a checksum of still has it: each rank checks a share, and
    every rank raises the first mismatch (a `CPConfigError` naming the file). A checkpoint saved
    before checksums were recorded is not checked."""
    recorded = (meta.get("checksums") or {}).get("files")
    if not recorded:
        return
    names = checksums.share(sorted(recorded), dist.get_rank(), dist.get_world_size())
    found = [problem for name in names if (problem := checksums.mismatch(path, name, recorded[name]))]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, found[0] if found else None)
    first = next((problem for problem in every if problem), None)
    if first is not None:
        raise CPConfigError(first)


def _load_state(path: str, model, optimizer, scheduler) -> None:
    state = trainer_state(model, optimizer, scheduler)
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:
        if isinstance(exc, Exception) and is_collective_failure(exc):
            raise
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {save_errors.load_cause(exc)}; remove that "
                              "step's folder to resume from an earlier one") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
