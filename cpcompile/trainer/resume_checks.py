"""What a checkpoint must be for a run to resume from it, checked from its files alone before
anything is built (`checkpoint.check_compatible` runs them): each failure is one `CPConfigError`
line naming the file and what differs, where DCP or `torch.load` would otherwise fail deep in
the resume with a long traceback (a size mismatch, a missing key, a bare `JSONDecodeError`, an
unreadable stream).

- `trainer.json`: JSON holding the step and the mesh sizes;
- `.metadata` (DCP's index of the saved tensors): present and readable;
- the shard files (`*.distcp`): each as long as the index says (a truncated copy is not);
- the model: the same tensor names and shapes as the run's model (built on the meta device),
  so another model size or layer count is named by its first differing tensor;
- `rng-rank0.pt`: present (the ranks without their own RNG file take it);
- with `train.verify`, the saved state of verify's unrewritten copies (`verify-<name>/`).
"""
from __future__ import annotations

import json
import os

import torch

from ..errors import CPConfigError

DCP_METADATA = ".metadata"
MODEL_PREFIX = "model."  # the model's state sits under "model" in the saved state (checkpoint.save)


def read_trainer_json(path: str) -> dict:
    """trainer.json as a dict with an integer step and cp_size; else a `CPConfigError` naming it."""
    try:
        with open(path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, and bytes that are not UTF-8
        raise CPConfigError(f"checkpoint {path} is damaged ({_first_line(exc)}): it cannot be resumed from; "
                            "remove that step's folder to resume from an earlier one") from exc
    missing = [key for key in ("step", "cp_size") if not isinstance(meta, dict) or type(meta.get(key)) is not int]
    if missing:
        raise CPConfigError(f"checkpoint {path} is damaged (no integer {', '.join(missing)}): it cannot be resumed "
                            "from; remove that step's folder to resume from an earlier one")
    return meta


def read_dcp_metadata(folder: str):
    """DCP's `Metadata` of the checkpoint in `folder`; a `CPConfigError` when it is missing or unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    path = os.path.join(folder, DCP_METADATA)
    if not os.path.isfile(path):
        raise CPConfigError(f"checkpoint {path} is missing: the save did not complete, or the file was removed; "
                            "remove that step's folder to resume from an earlier one")
    try:
        return FileSystemReader(folder).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything
        raise CPConfigError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {_first_line(exc)}); "
                            "remove that step's folder to resume from an earlier one") from exc


def check_shard_files(folder: str, metadata) -> None:
    """Every file the index points into exists and is at least as long as its last stored item."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CPConfigError(f"checkpoint {path} is missing ({DCP_METADATA} lists it); remove that step's folder "
                                "to resume from an earlier one")
        size = os.path.getsize(path)
        if size < length:
            raise CPConfigError(f"checkpoint {path} is truncated: {size} bytes, and {DCP_METADATA} says it holds "
                                f"{length}; remove that step's folder to resume from an earlier one")


def check_model_tensors(folder: str, metadata, model: torch.nn.Module) -> None:
    """The checkpoint's model tensors have the names and shapes of `model`'s state."""
    saved = {key[len(MODEL_PREFIX):]: tuple(item.size) for key, item in metadata.state_dict_metadata.items()
             if key.startswith(MODEL_PREFIX) and hasattr(item, "size")}
    wanted = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    where = os.path.join(folder, DCP_METADATA)
    advice = "resume with the checkpoint's model: section, or start a new checkpoint.folder"
    only_saved, only_wanted = sorted(set(saved) - set(wanted)), sorted(set(wanted) - set(saved))
    if only_saved or only_wanted:
        parts = [f"{len(names)} tensor(s) only in {owner} (first: {names[0]})"
                 for names, owner in ((only_saved, "the checkpoint"), (only_wanted, "this run's model")) if names]
        raise CPConfigError(f"checkpoint {where}: another model (a different layer count or architecture?): "
                            f"{'; '.join(parts)}; {advice}")
    differ = [key for key in wanted if saved[key] != wanted[key]]
    if differ:
        key = differ[0]
        raise CPConfigError(f"checkpoint {where}: another model size: {key} is {list(saved[key])} there and "
                            f"{list(wanted[key])} in this run's model ({len(differ)} tensor(s) differ); {advice}")


def check_rng_file(folder: str) -> None:
    path = os.path.join(folder, "rng-rank0.pt")
    if not os.path.isfile(path):
        raise CPConfigError(f"checkpoint {path} is missing (every rank without its own RNG file takes it); "
                            "remove that step's folder to resume from an earlier one")


def check_reference_folder(folder: str, name: str) -> None:
    """A run with `train.verify` resumes its unrewritten copies from the checkpoint's `name` folder."""
    path = os.path.join(folder, name)
    if not os.path.isfile(os.path.join(path, DCP_METADATA)):
        raise CPConfigError(f"checkpoint {path} is missing: the checkpoint was saved without train.verify, so "
                            "verify's unrewritten copies cannot resume from it (rebuilt from the seed, they would "
                            "judge the resumed steps against step 1's weights); resume with train.verify: false, or "
                            "start a new checkpoint.folder")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
