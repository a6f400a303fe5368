"""What a run checks before it builds anything (no process group, no model weights yet), so that
a mistake found only at the first checkpoint save, or deep inside a resume, is one line naming
its field or file at start-up instead:

- the places the run writes: `checkpoint.folder` (created, writable, with room for one
  checkpoint by a rough estimate) on every rank, since each writes its shard there, and
  `train.metrics_file` (its folder created, the file writable) where it is written, on rank 0;
- the checkpoint a run resumes from (`checkpoint.check_compatible`);
- else the pretrained weights of `model.path` (`weights.check_weights_fit`: every tensor there,
  of the model's shape, and none the model lacks), from the safetensors headers.

All need the model's parameters, which a model on the meta device gives for free.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from ..errors import PlanError, short_repr
from . import checkpoint
from .config import TrainConfig, pretrained_folder
from .config_sections import DTYPES
from .parallelize import meta_model
from .weights import check_weights_fit

GIB = 2.0 ** 30
# Parameters and AdamW's two moments, in the parameters' dtype; the rest (scheduler, RNG, DCP's
# metadata) is small beside them.
STATES_PER_PARAMETER = 3


def check_before_building(config: TrainConfig) -> int | None:
    """The start-up checks of the module doc; -> the step of the checkpoint to resume from, if any."""
    saving = config.checkpoint
    model = None
    if saving.folder is not None:
        check_writable_folder("checkpoint.folder", saving.folder)
        model = meta_model(config.model)
        check_room_for_a_checkpoint(saving.folder, checkpoint_bytes(model, config.train.dtype))
    if config.train.metrics_file is not None and _rank() == 0:
        check_writable_file("train.metrics_file", config.train.metrics_file)
    latest = checkpoint.latest_step(saving.folder) if saving.resume else None
    if latest is not None:
        checkpoint.check_compatible(saving.folder, latest, config, model)
    elif (pretrained := pretrained_folder(config.model)) is not None:  # a resume overwrites them: not loaded
        check_weights_fit(model if model is not None else meta_model(config.model), pretrained)
    return latest


def check_writable_folder(field: str, folder: str) -> None:
    """`folder` exists (created now if not) and a file can be written in it; else a `PlanError`."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise PlanError(field, f"{short_repr(folder)} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        # a name of this process's own: every rank checks the same folder at the same time
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".cpcompile-write-check-"):
            pass
    except OSError as exc:
        raise PlanError(field, f"cannot write in {short_repr(folder)}: {exc.strerror or exc}") from exc


def check_writable_file(field: str, path: str) -> None:
    """`path` can be opened for writing (its folder created now if not); a file this check
    creates is removed again."""
    if os.path.isdir(path):
        raise PlanError(field, f"{short_repr(path)} is a folder, not a file")
    existed = os.path.exists(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
        if not existed:
            os.remove(path)
    except OSError as exc:
        raise PlanError(field, f"cannot write {short_repr(path)}: {exc.strerror or exc}") from exc


def checkpoint_bytes(model: torch.nn.Module, dtype: str) -> int:
    """A rough size of one checkpoint of `model` trained in `dtype`, all ranks' shards together."""
    element = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return STATES_PER_PARAMETER * element * sum(p.numel() for p in model.parameters())


def check_room_for_a_checkpoint(folder: str, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise PlanError("checkpoint.folder", f"{short_repr(folder)} has {free / GIB:.3g} GiB free, and one "
                                             f"checkpoint needs about {needed / GIB:.3g} GiB (parameters and "
                                             "AdamW's two moments)")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
