"""Each CP rank's expected peak memory under a suggested plan: the trainer's own estimate
(`trainer/memory.py`, what `cpcompile train --dry-run` prints), for one sequence in bfloat16
with every decoder layer checkpointed, the trainer's defaults for long sequences."""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from ..errors import CPCompileError
from ..plan import load_plan
from ..trainer import memory
from ..trainer.config import TrainConfig
from ..trainer.config_sections import TrainSettings

SETTINGS = {"batch_size": 1, "dtype": "bfloat16", "device": "cuda", "activation_checkpointing": "every_layer"}


def expected_memory_gib(model: nn.Module, plan: dict, seq_len: int) -> list[float] | str:
    """Each CP rank's estimated peak (GiB), or why there is none: the estimate knows Hugging Face
    decoder configs (attention and GDN layers), not every model."""
    model_config = getattr(model, "config", None)
    if model_config is None or not hasattr(model_config, "num_hidden_layers") and \
            not hasattr(model_config, "get_text_config"):
        return "not estimated: the memory model reads a Hugging Face decoder config, and this model has none"
    try:
        train = dataclasses.replace(TrainSettings(), seq_len=seq_len, **SETTINGS)
        config = TrainConfig(model={}, train=train, plan=load_plan(plan))
        params = sum(p.numel() for p in model.parameters())
        cp = config.plan.accelerator.cp_size
        return [memory.estimate(config, params, model_config, rank)["total"] for rank in range(cp)]
    except (CPCompileError, AttributeError, TypeError) as exc:  # a config the estimate does not know
        return f"not estimated: {type(exc).__name__}: {exc}"
