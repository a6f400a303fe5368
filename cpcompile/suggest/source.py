"""`cpcompile plan`'s argument as a model to look at: a local Hugging Face folder or its
config.json, or a `cpcompile train` YAML (its `model:` section, and its `accelerator.cp_size` and
`train.seq_len` as defaults). The model is built with its parameters on the meta device: looking
at a large model allocates nothing (`sites.find_core_sites` probes it with stand-ins)."""
from __future__ import annotations

import os

import torch.nn as nn

from ..errors import CPInputError
from ..yaml_input import read_yaml

YAML_SUFFIXES = (".yaml", ".yml")


def read_source(source: str) -> tuple[dict, dict]:
    """-> (the trainer's `model:` section, defaults read from a train YAML: cp, seq_len)."""
    if os.path.isdir(source) or source.endswith(".json"):
        if not os.path.exists(source):
            raise CPInputError(f"cpcompile plan: {source} does not exist")
        return {"path": source}, {}
    if source.endswith(YAML_SUFFIXES):
        raw = read_yaml(source)
        model = raw.get("model") if isinstance(raw, dict) else None
        if not isinstance(model, dict):
            raise CPInputError(f"cpcompile plan: {source} has no `model:` section (a cpcompile train YAML)")
        defaults = {"cp": (raw.get("accelerator") or {}).get("cp_size"), "seq_len": (raw.get("train") or {}).get("seq_len")}
        return model, {key: value for key, value in defaults.items() if value is not None}
    raise CPInputError(f"cpcompile plan: {source!r} is neither a Hugging Face folder, a config.json nor a "
                       "cpcompile train YAML (.yaml)")


def meta_model(model_section: dict) -> nn.Module:
    """The causal LM the section describes, parameters on the meta device, buffers real (CPU)."""
    from ..trainer.config_sections import TrainSettings
    from ..trainer.parallelize import build_model

    return build_model(model_section, TrainSettings(), parameters_on_meta=True)
