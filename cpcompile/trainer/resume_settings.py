"""The settings that fix a run's trajectory, recorded in each checkpoint's trainer.json and
compared at resume: a resumed run must train as the run that saved would have, or say so.

Changed at a resume without a word, each of these would give another loss curve than the one
the checkpoint's run was on (issue 47): the data (`data.*`, and the data file's size, so an
edited file at the same path counts), `train.seq_len`, `train.batch_size` (which rows a step
reads), `train.seed` (synthetic rows), `train.dtype`, `train.mixed_precision`,
`train.grad_clip`, AdamW's `optimizer.weight_decay` / `betas` / `eps`, the LR schedule
(`train.steps`, `train.lr`, `optimizer.warmup_steps`, `optimizer.schedule`,
`optimizer.min_lr_ratio`) and the `model:` section (what shapes do not show: `rope_theta`, an
epsilon). A resume with any of them changed is refused, before anything is built, unless
`checkpoint.allow_changes` lists the field (a curriculum that lengthens `seq_len`, say); the
resumed run then says which fields changed in its first line, and runs with the new values
(`apply_to_optimizer` puts the new optimizer and schedule values in place of those the optimizer
and scheduler restore from the checkpoint).

What changes only rounding (activation checkpointing, `compile_backend`, the loss's chunking, the
GDN kernels, `sdpa_backend`) and where the run writes are not recorded; nor is `cp_size`, which
is refused on its own (`checkpoint.check_compatible`).
"""
from __future__ import annotations

import json
import os

from ..errors import CPConfigError

SCHEDULE_FIELDS = ("train.steps", "train.lr", "optimizer.warmup_steps", "optimizer.schedule",
                   "optimizer.min_lr_ratio")
TRAIN_FIELDS = ("train.seq_len", "train.batch_size", "train.seed", "train.dtype", "train.mixed_precision",
                "train.grad_clip")
OPTIMIZER_FIELDS = ("optimizer.weight_decay", "optimizer.betas", "optimizer.eps")
DATA_FIELDS = ("data.source", "data.path", "data.text_field", "data.tokenizer", "data.packing")
FIELDS = (*TRAIN_FIELDS, *SCHEDULE_FIELDS, *OPTIMIZER_FIELDS, *DATA_FIELDS, "model")


def recorded(config) -> dict:
    """Every field of `FIELDS` of `config`, by its path, as JSON would give it back."""
    values = {"model": config.model}
    for name in FIELDS:
        section, _, key = name.partition(".")
        if key:
            values[name] = getattr(getattr(config, section), key)
    values["data.path"] = data_file_identity(config.data.path)
    return json.loads(json.dumps(values, default=str))


def data_file_identity(path: str | None) -> str | None:
    """The data file as recorded: its path and size (an edited file at the same path has changed)."""
    if path is None or not os.path.isfile(path):
        return path
    return f"{path} ({os.path.getsize(path)} bytes)"


def changes(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(field, saved value, this run's value) for each recorded field that differs."""
    return [(name, saved.get(name), value) for name, value in now.items() if name in saved and saved[name] != value]


def describe(found: list[tuple[str, object, object]]) -> str:
    return ", ".join(f"{name} {old!r} -> {new!r}" for name, old, new in found)


def check(meta: dict, config, where: str) -> list[tuple[str, object, object]]:
    """Refuse, in one line naming `where` (the trainer.json) and each field, a resume that
    changes a recorded field `checkpoint.allow_changes` does not list; -> the changes it allows.
    A checkpoint that recorded only its schedule (before this version) is held to that."""
    saved = meta.get("settings")
    if saved is None:
        saved = meta.get("schedule") or {}
    found = changes(saved, recorded(config))
    allowed = set(config.checkpoint.allow_changes)
    refused = [change for change in found if change[0] not in allowed]
    if refused:
        raise CPConfigError(f"{where}: {_refusal(refused)}; resume with the checkpoint's values, list the field(s) "
                            "in checkpoint.allow_changes to change them on purpose, or start a new checkpoint.folder")
    return found


def _refusal(refused: list) -> str:
    names = [name for name, _, _ in refused]
    text = f"the checkpoint was saved with other settings that change the training trajectory ({describe(refused)})"
    if any(name in SCHEDULE_FIELDS for name in names):
        text = (f"the checkpoint was saved with another LR schedule or other settings ({describe(refused)}): the "
                "scheduler and optimizer restore the old schedule, so resuming would mix two schedules")
    return text


def apply_to_optimizer(optimizer, scheduler, config) -> None:
    """Put this run's AdamW values and LR schedule in place of those the optimizer and scheduler
    restored from the checkpoint, at the restored step. Where nothing changed this writes the same
    values back (the LR is computed by the same expression LambdaLR uses), so a plain resume stays
    bit for bit the uninterrupted run."""
    opt, lr = config.optimizer, config.train.lr
    # LambdaLR saves no plain function, so its lambdas are this run's (`optimizer.build_optimizer`)
    factors, step = scheduler.lr_lambdas, scheduler.last_epoch
    for group, factor in zip(optimizer.param_groups, factors):
        group.update(betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, initial_lr=lr)
        group["lr"] = lr * factor(step)
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() returns
