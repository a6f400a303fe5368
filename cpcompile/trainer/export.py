"""A checkpoint as a Hugging Face folder: `cpcompile export CHECKPOINT OUT_DIR`, and
`checkpoint.export: true` at the end of `train` (to `<checkpoint.folder>/hf`).

The folder `AutoModelForCausalLM.from_pretrained` reads: `config.json` (the model's config, which
every checkpoint step records beside trainer.json, with its class and dtype), the weights as
safetensors (`model.safetensors`, or `model-0000k-of-0000n.safetensors` shards and
`model.safetensors.index.json` when they exceed `max_shard_bytes`), and the tokenizer files of the
run's `data.tokenizer` folder when its trainer.json names one.

The weights are the checkpoint's model tensors (DCP's `.metadata` says their names, shapes and
dtypes), under the model's own parameter names, a tied one (`lm_head.weight` beside
`embed_tokens`) written once as `save_pretrained` does. They are read a shard at a time with
`dcp.load` into whole tensors (DCP reassembles each from the ranks' pieces), so a process holds
one shard, not the model. In `train`, the ranks write the shards between them.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import warnings

import torch

from ..errors import CPConfigError
from . import checkpoint, resume_checks
from .checkpoint import CONFIG_FILE
from .config_sections import DTYPES
from .hf_config import transformers_module
from .weights import INDEX_FILE, tied_duplicates

DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9  # transformers' default shard size (also the CLI's --max-shard-mb)
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "*.model", "vocab*", "merges.txt",
                   "chat_template*")


def step_folder_of(path: str) -> str:
    """`path` itself when it is a checkpoint step (it has trainer.json), else the latest complete
    step in it (a `checkpoint.folder`); a `CPConfigError` when it is neither."""
    if os.path.isfile(os.path.join(path, checkpoint.META_FILE)):
        return path
    latest = checkpoint.latest_step(path)
    if latest is None:
        raise CPConfigError(f"{path} is not a checkpoint: neither a step folder (with {checkpoint.META_FILE}) nor a "
                            "checkpoint.folder holding a complete step-<n>")
    return checkpoint.step_folder(path, latest)


def saved_config(step: str):
    """The transformers config the checkpoint recorded (its config.json)."""
    if not os.path.isfile(os.path.join(step, CONFIG_FILE)):
        raise CPConfigError(f"{os.path.join(step, CONFIG_FILE)} is missing: this checkpoint was saved before the trainer "
                            "recorded the model's config; it cannot be exported")
    return transformers_module().AutoConfig.from_pretrained(step, local_files_only=True)


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


class Export:
    """What an export of the checkpoint step `step` writes: the model's class and config, and its
    tensors grouped into shards of at most `max_shard_bytes` (a larger tensor gets a shard alone)."""

    def __init__(self, step: str, dtype: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        transformers = transformers_module()
        self.step = step
        self.config = saved_config(step)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(self.config)
        metadata = resume_checks.read_dcp_metadata(step)
        resume_checks.check_shard_files(step, metadata)
        resume_checks.check_model_tensors(step, metadata, model)
        self.architecture = type(model).__name__
        saved = metadata.state_dict_metadata
        tied = tied_duplicates(model)
        names = [name for name in model.state_dict() if name not in tied]
        self.sizes = {name: tuple(saved[resume_checks.MODEL_PREFIX + name].size) for name in names}
        self.saved_dtypes = {name: saved[resume_checks.MODEL_PREFIX + name].properties.dtype for name in names}
        # the dtype trained (train.dtype: every parameter has it), unless asked for another
        self.dtype = DTYPES[dtype] if dtype is not None else self.saved_dtypes[names[0]]
        self.shards = self._group(names, max_shard_bytes)
        self.tokenizer = tokenizer_folder(step)

    def _bytes(self, name: str) -> int:
        """The size of tensor `name` as written."""
        return torch.Size(self.sizes[name]).numel() * torch.empty((), dtype=self.dtype).element_size()

    def _group(self, names: list[str], max_shard_bytes: int) -> list[list[str]]:
        shards: list[list[str]] = [[]]
        used = 0
        for name in names:
            size = self._bytes(name)
            if shards[-1] and used + size > max_shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append(name)
            used += size
        return shards

    def write_shards(self, folder: str, indices) -> None:
        """Write the shards `indices` (of `self.shards`) into `folder`, one at a time."""
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file

        files = shard_names(len(self.shards))
        for index in indices:
            tensors = {name: torch.empty(self.sizes[name], dtype=self.saved_dtypes[name]) for name in self.shards[index]}
            with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent here
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                # no_dist: this process reads alone, whether or not a process group is up
                dcp.load({resume_checks.MODEL_PREFIX.rstrip("."): tensors}, checkpoint_id=self.step, no_dist=True)
            save_file({name: t.to(self.dtype).contiguous() for name, t in tensors.items()},
                      os.path.join(folder, files[index]), metadata={"format": "pt"})

    def write_rest(self, folder: str) -> None:
        """config.json, the index (sharded only) and the tokenizer files."""
        self.config.architectures = [self.architecture]
        self.config.dtype = self.dtype
        self.config.save_pretrained(folder)
        files = shard_names(len(self.shards))
        if len(files) > 1:
            total = sum(self._bytes(name) for name in self.sizes)
            weight_map = {name: files[k] for k, shard in enumerate(self.shards) for name in shard}
            with open(os.path.join(folder, INDEX_FILE), "w", encoding="utf-8") as handle:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)
        if self.tokenizer is not None:
            copy_tokenizer_files(self.tokenizer, folder)


def tokenizer_folder(step: str) -> str | None:
    """The run's `data.tokenizer` folder, as its trainer.json recorded it (None when it names none)."""
    meta_path = os.path.join(step, checkpoint.META_FILE)
    meta = resume_checks.read_trainer_json(meta_path)
    folder = (meta.get("data") or {}).get("tokenizer")
    if folder is not None and not os.path.isdir(folder):
        raise CPConfigError(f"{meta_path}: the run's data.tokenizer {folder} is not a folder (any more): its "
                            "tokenizer files cannot be exported")
    return folder


def copy_tokenizer_files(source: str, folder: str) -> None:
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if os.path.isfile(path) and any(fnmatch.fnmatch(name, pattern) for pattern in TOKENIZER_FILES):
            shutil.copy2(path, os.path.join(folder, name))


def export_folder(checkpoint_folder: str) -> str:
    """Where `checkpoint.export: true` writes: `<checkpoint.folder>/hf`."""
    return os.path.join(checkpoint_folder, "hf")


def partial_folder(out_dir: str) -> str:
    """Where an export is written before it becomes `out_dir` (so a failed one leaves no half folder)."""
    return os.path.normpath(out_dir) + ".partial"


def check_out_dir(out_dir: str) -> None:
    """`cpcompile export` writes a new folder: an existing one must be empty (never mixed with old files)."""
    if os.path.isfile(out_dir) or (os.path.isdir(out_dir) and os.listdir(out_dir)):
        raise CPConfigError(f"{out_dir} exists and is not an empty folder: export into a new one")


def fresh_folder(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def publish(partial: str, out_dir: str) -> None:
    """Put the finished export at `out_dir`, replacing a previous one there."""
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(partial, out_dir)


def export(checkpoint_path: str, out_dir: str, dtype: str | None = None,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """One process: write the checkpoint (a step folder, or a checkpoint.folder's latest step) as a
    Hugging Face folder `out_dir` (new or empty); -> the step exported."""
    check_out_dir(out_dir)
    plan = Export(step_folder_of(checkpoint_path), dtype, max_shard_bytes)
    partial = partial_folder(out_dir)
    fresh_folder(partial)
    plan.write_shards(partial, range(len(plan.shards)))
    plan.write_rest(partial)
    publish(partial, out_dir)
    return plan.step


def export_from_ranks(step: str, out_dir: str) -> None:
    """Every rank of a run: write the checkpoint step `step` to `out_dir` (replacing a previous
    export there), the shards split over the ranks; rank 0 writes the rest and publishes it."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    plan = Export(step)
    partial = partial_folder(out_dir)
    if rank == 0:
        fresh_folder(partial)
    dist.barrier()
    plan.write_shards(partial, range(rank, len(plan.shards), world))
    dist.barrier()
    if rank == 0:
        plan.write_rest(partial)
        publish(partial, out_dir)
    dist.barrier()
