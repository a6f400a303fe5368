"""Pretrained weights from a local Hugging Face folder (`model.path`), loaded shard by shard.

The folder holds `config.json` and its weights as safetensors: one `model.safetensors`, or shards
listed by `model.safetensors.index.json`. The model is built and parallelized as for random
weights (TP, the CP rewrite, activation checkpointing, FSDP2); then each rank reads only the
slices of the tensors it owns, through PyTorch DCP's `HuggingFaceStorageReader` (`safe_open` +
`get_slice` under DCP's load planner, which knows the FSDP2 / TP DTensor layouts). No rank reads
a whole tensor it does not own.

The model is built with its parameters on the meta device (`parameters_on_meta`), so that no
rank ever holds the whole model: they exist only as FSDP2 shards, materialised empty and filled
from the files. Nothing before the load needs their values: the CP rewrite (cp_size > 1) probes
and traces the model with fake parameters in their place (cpcompile/meta_params.py), TP and
FSDP2 shard meta tensors. Its buffers (rotary `inv_freq`, not in the files) are built for real,
as for random weights, on the run's device (the CP rewrite's probe computes from them).

What is checked, from the files' headers and the model's names and shapes (before any process
starts, and again at the load), each a `PlanError` on `model.path` naming the file and tensor:
no safetensors at all (unless `model.weights: random`), more than one file without an index, an
index naming a missing file or missing a present one, a tensor stored twice, a model tensor the
files lack (a tied one, `lm_head.weight` beside `embed_tokens`, may be absent), a tensor whose
shape differs, tensors the model does not have (config.json does not match the weights; those
transformers itself ignores for the model class, e.g. Qwen3.5's `mtp.*`, pass). Checkpoint names
are mapped to the model's by transformers' own renaming rules for the model class (a Qwen3.5
vision-language checkpoint's `model.language_model.*` is the text model's `model.*`).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass

import torch

from ..errors import PlanError

WEIGHTS_CHOICES = ("pretrained", "random")
INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"
FIELD = "model.path"


# --------------------------------------------------------------------------- the folder's files


def weights_files(folder: str) -> list[str]:
    """The safetensors files holding the folder's weights (paths), checked against the index
    when there is one; a `PlanError` on `model.path` naming what is wrong."""
    present = sorted(name for name in os.listdir(folder) if name.endswith(SUFFIX))
    index_path = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(index_path):
        if not present:
            raise PlanError(FIELD, f"{folder} holds no *{SUFFIX} weights: nothing to load (set "
                                   "model.weights: random to train this config.json from random weights)")
        if len(present) > 1:
            raise PlanError(FIELD, f"{folder} holds {len(present)} *{SUFFIX} files and no {INDEX_FILE} "
                                   "saying which tensor each holds")
        return [os.path.join(folder, present[0])]
    listed = sorted(set(_read_index(index_path).values()))
    missing = [name for name in listed if name not in present]
    if missing:
        raise PlanError(FIELD, f"{os.path.join(folder, missing[0])} is missing: {INDEX_FILE} lists it "
                               f"({len(missing)} of its {len(listed)} files missing)")
    unlisted = [name for name in present if name not in listed]
    if unlisted:  # DCP's reader reads every *.safetensors of the folder: a stray one would be read too
        raise PlanError(FIELD, f"{os.path.join(folder, unlisted[0])} is not listed in {INDEX_FILE}: a leftover of "
                               "another save? remove it")
    return [os.path.join(folder, name) for name in listed]


def _read_index(path: str) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> file name)."""
    try:
        with open(path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PlanError(FIELD, f"{path} is not a safetensors index (JSON with a weight_map): {exc}") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise PlanError(FIELD, f"{path}: weight_map must map tensor names to file names")
    return weight_map


@dataclass(frozen=True)
class StoredTensor:
    file: str
    shape: tuple[int, ...]


def stored_tensors(folder: str) -> dict[str, StoredTensor]:
    """Every tensor of the folder's weights: its file and shape, from the files' headers."""
    from safetensors import safe_open

    stored: dict[str, StoredTensor] = {}
    for path in weights_files(folder):
        try:
            with safe_open(path, framework="pt") as handle:
                for key in handle.keys():
                    if key in stored:
                        raise PlanError(FIELD, f"{path}: tensor {key} is also in {stored[key].file}")
                    stored[key] = StoredTensor(path, tuple(handle.get_slice(key).get_shape()))
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own errors for a damaged header
            raise PlanError(FIELD, f"{path} cannot be read as safetensors ({type(exc).__name__}: {exc})") from exc
    return stored


# --------------------------------------------------------------------------- names and shapes


def tied_duplicates(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another, earlier-named parameter (tied embeddings: lm_head.weight)."""
    first: dict[int, str] = {}
    tied = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            tied.add(name)
        else:
            first[id(parameter)] = name
    return tied


def checkpoint_renamer(model: torch.nn.Module, model_keys: set[str]):
    """checkpoint name -> (model name, converter pattern or None), by transformers' own rules for
    the model class (those `from_pretrained` applies). A converter (a tensor split or merged on
    load) cannot be applied to a rank's slice; the caller refuses it."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # a transformers without these rules: names are taken as the model's own
        return lambda key: (key, None)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    known = dict.fromkeys(model_keys, True)  # what rename_source_key consults to add / strip the base prefix
    return lambda key: rename_source_key(key, renamings, converters, model.base_model_prefix, known)


def match_tensors(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], folder: str) -> dict[str, str]:
    """{model tensor name: checkpoint name} for every tensor of `shapes` (the model's state: name ->
    global shape) that the folder must supply; a `PlanError` naming the file and tensor when the
    folder does not fit the model."""
    stored = stored_tensors(folder)
    rename = checkpoint_renamer(model, set(shapes))
    ignorable = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    names: dict[str, str] = {}
    unexpected = []
    for key, item in stored.items():
        target, converter = rename(key)
        if converter is not None:
            raise PlanError(FIELD, f"{item.file}: tensor {key} is stored in a layout transformers converts on load "
                                   f"({converter}): the sharded load reads tensors as stored; not supported")
        if target in shapes:
            names[target] = key
        elif not any(p.search(key) or p.search(target) for p in ignorable):
            unexpected.append(key)
    if unexpected:
        raise PlanError(FIELD, f"{stored[unexpected[0]].file}: tensor {unexpected[0]} is not in the model built from "
                               f"{os.path.join(folder, 'config.json')} ({len(unexpected)} such tensor(s)): config.json "
                               "does not match the weights")
    tied = tied_duplicates(model)
    for target, shape in shapes.items():
        key = names.get(target)
        if key is None:
            if target in tied:
                continue  # the tensor it is tied to is loaded
            raise PlanError(FIELD, f"{folder} has no tensor {target} (the model built from its "
                                   "config.json has it): the weights are incomplete or of another model")
        if stored[key].shape != tuple(shape):
            raise PlanError(FIELD, f"{stored[key].file}: tensor {key} is {list(stored[key].shape)} there and "
                                   f"{list(shape)} in the model built from config.json: config.json does not match "
                                   "the weights")
    return names


def check_weights_fit(model: torch.nn.Module, folder: str) -> None:
    """The folder's weights fit `model` (on the meta device): `match_tensors`, before anything is built."""
    match_tensors(model, {k: tuple(v.shape) for k, v in model.state_dict().items()}, folder)


# --------------------------------------------------------------------------- building and loading


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """`model`'s transformers class built again from its config on the meta device: what the
    name rules are looked up on. FSDP2 swaps a wrapped model's class for a subclass of its own,
    which transformers takes for custom code and gives none of its renaming rules."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model.config)


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device and keep their buffers real
    (computed as usual: rotary frequencies are in no checkpoint)."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, parameter):
        if parameter is not None and parameter.device.type != "meta":
            parameter = torch.nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)
        register(module, name, parameter)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def buffers_to(model: torch.nn.Module, device: str) -> None:
    """Move the buffers of a model built by `parameters_on_meta` to `device`, its parameters left
    on meta (`Module.to` would move those too, and a meta tensor has nothing to copy)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def materialize(model: torch.nn.Module, device: str) -> None:
    """Give a model built by `parameters_on_meta` (and sharded by FSDP2) empty storage on `device`
    for its parameters, keeping its buffers' values (`to_empty` would empty them too)."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


def load_pretrained(model: torch.nn.Module, folder: str) -> None:
    """Every rank: fill `model`'s parameters (plain, FSDP2 or TP DTensors) from the folder's
    safetensors, each rank reading only its own slices (DCP's `HuggingFaceStorageReader`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    names = match_tensors(meta_twin(model), {k: tuple(v.shape) for k, v in state.items()}, folder)
    dcp.load({key: state[target] for target, key in names.items()}, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(model, state)
