"""Checkpoints with `torch.distributed.checkpoint` (DCP): `<folder>/step-<n>/`.

Saved: the model and optimizer state (`get_state_dict`, sharded DTensors as FSDP2 holds them;
DCP reshards them on load, so a run may resume with another dp_shard / dp_replicate size), the
LR scheduler, the step (which is the data position: `data.py`), each rank's RNG states
(`rng-rank<r>.pt` beside the DCP files; a rank that finds none of its own takes rank 0's), and
the model's transformers config (`config.json`, for `export.py`). A
checkpoint's CP size must be the run's: another one is refused (`trainer.json` records it). So is
another LR schedule (`train.steps`, `train.lr`, `optimizer.warmup_steps`, `optimizer.schedule`,
`optimizer.min_lr_ratio`): the scheduler and the optimizer's learning rates are restored as
saved, so the next step would run at the old schedule's rate and the later ones at the new
one's — two schedules mixed, silently. A run meant to go longer starts a new checkpoint folder.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..errors import CPConfigError
from . import resume_checks

STEP_FOLDER = re.compile(r"^step-(\d+)$")
META_FILE = "trainer.json"
CONFIG_FILE = "config.json"  # the model's transformers config


def step_folder(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def latest_step(folder: str | None) -> int | None:
    """The highest step with a complete checkpoint (its trainer.json written last) in `folder`."""
    if folder is None or not os.path.isdir(folder):
        return None
    steps = [int(m.group(1)) for name in os.listdir(folder) if (m := STEP_FOLDER.match(name))
             and os.path.isfile(os.path.join(folder, name, META_FILE))]
    return max(steps, default=None)


def run_facts(config) -> dict:
    """What trainer.json records of the run besides the step: the mesh sizes, the LR schedule, and
    the data settings (`export` reads the tokenizer folder from them)."""
    accelerator = config.plan.accelerator
    facts = {name: getattr(accelerator, name) for name in ("cp_size", "dp_shard_size", "dp_replicate_size")}
    return {**facts, "schedule": schedule_fields(config), "data": dataclasses.asdict(config.data)}


def schedule_fields(config) -> dict:
    """The fields that fix the LR of every step (`loop.build_optimizer`), by their config path."""
    optimizer = config.optimizer
    return {"train.steps": config.train.steps, "train.lr": config.train.lr,
            "optimizer.warmup_steps": optimizer.warmup_steps, "optimizer.schedule": optimizer.schedule,
            "optimizer.min_lr_ratio": optimizer.min_lr_ratio}


def check_compatible(folder: str, step: int, config, model: torch.nn.Module | None = None) -> None:
    """Refuse, before anything is built, in one line naming the file and what differs, a
    checkpoint this run cannot resume from: a damaged trainer.json, another CP size or LR
    schedule, a missing or unreadable DCP index, a missing or truncated shard, another model
    (`model`, on the meta device: its tensor names and shapes; not checked without it), a
    missing RNG file (resume_checks.py)."""
    path = step_folder(folder, step)
    meta = resume_checks.read_trainer_json(os.path.join(path, META_FILE))
    saved, cp_size = meta["cp_size"], config.plan.accelerator.cp_size
    if saved != cp_size:
        raise CPConfigError(f"checkpoint {path} was saved with cp_size={saved} and this run has "
                            f"cp_size={cp_size}: resuming with another CP size is not supported (use "
                            "the checkpoint's cp_size, or another checkpoint.folder)")
    check_schedule(meta.get("schedule"), schedule_fields(config), os.path.join(path, META_FILE))
    metadata = resume_checks.read_dcp_metadata(path)
    resume_checks.check_shard_files(path, metadata)
    if model is not None:
        resume_checks.check_model_tensors(path, metadata, model)
    resume_checks.check_rng_file(path)


def check_schedule(saved: dict | None, now: dict, where: str) -> None:
    """The run's LR schedule must be the checkpoint's (see the module doc). A checkpoint written
    before trainer.json recorded it (no `schedule`) is not checked."""
    if saved is None:
        return
    changed = [f"{name} {saved.get(name)!r} -> {value!r}" for name, value in now.items() if saved.get(name) != value]
    if changed:
        raise CPConfigError(f"{where}: the checkpoint was saved with another LR schedule ({', '.join(changed)}): "
                            "resuming would run the next step at the old schedule's rate and the later ones at the "
                            "new one's; resume with the checkpoint's values, or start a new checkpoint.folder")


def save(folder: str, step: int, model, optimizer, scheduler, facts: dict) -> str:
    """Every rank: DCP-save the states of `step` (completed steps); rank 0 writes the model's
    transformers config (config.json, what `export` writes out with the weights), then
    trainer.json (the step and `facts`: `run_facts`) last."""
    path = step_folder(folder, step)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}, checkpoint_id=path)
    torch.save(_rng_state(), os.path.join(path, f"rng-rank{dist.get_rank()}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        model.config.to_json_file(os.path.join(path, CONFIG_FILE))
        with open(os.path.join(path, META_FILE), "w", encoding="utf-8") as handle:
            json.dump({"step": step, **facts}, handle, default=str)
    dist.barrier()
    return path


def load(folder: str, step: int, model, optimizer, scheduler) -> int:
    """Every rank: restore the checkpoint of `step` (`check_compatible` first); -> the step to continue from."""
    path = step_folder(folder, step)
    with open(os.path.join(path, META_FILE), encoding="utf-8") as handle:
        meta = json.load(handle)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    own = os.path.join(path, f"rng-rank{dist.get_rank()}.pt")
    _set_rng_state(torch.load(own if os.path.isfile(own) else os.path.join(path, "rng-rank0.pt"), weights_only=False))
    return meta["step"]


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
