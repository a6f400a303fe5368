"""The trainer's YAML: what to train, on which mesh, with what data, optimizer and checkpoints.

One file holds the CP plan (`accelerator:`, `plan_overrides:`, as for `load_plan`), `model:` and the
sections `train:`, `optimizer:`, `data:` and `checkpoint:`. Every section key is optional: each is
declared once, with its default, type and meaning, as a field of the dataclasses in
`config_sections.py`; `python -m cpcompile config-reference` prints them all (docs/trainer.md holds
that print). Errors name the field path, e.g. `optimizer.warmup_steps: must be an integer >= 0`.

`model:` is either a transformers config, `AutoConfig.for_model(model_type, **rest)` (`model_type`
and its keys; read in `hf_config.py`; random weights, seeded), or `path:` a local Hugging Face
folder (config.json and its safetensors; nothing is downloaded) with `weights: pretrained` (the
default with `path`: loaded after TP, CP, AC and FSDP2, each rank reading its own slices,
trainer/weights.py; not when the run resumes from a checkpoint) or `weights: random` (its
config.json only, seeded).

Mesh: `accelerator.dp_replicate_size` x `dp_shard_size` x `cp_size` x `tp_size` processes
(`cpcompile train --nproc-per-node N`, or torchrun); FSDP2 shards over `dp_shard x cp` and
replicates over `dp_replicate`. `tp_size > 1` (SDPA models, with cp_size > 1; not with
dp_replicate) splits every layer's heads and MLP over tp. PP and EP are refused.

Each section checks its own fields when built (`field_checks.Section`); here the whole file is
loaded (`load_train_config`) and checked across sections and against the model.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, fields
from typing import Any, Literal

from ..errors import PlanError, short_repr
from ..plan import TOP_LEVEL_KEYS, Plan, load_plan
from ..sequence_layout import required_multiple
from ..yaml_input import read_yaml, reject_unknown_keys
from .activation_checkpointing import check_layer_count
from .config_sections import SECTIONS, CheckpointSettings, DataSettings, OptimizerSettings, TrainSettings
from .field_checks import check_value
from .hf_config import model_config
from .tokenizer import tokenizer_for
from .weights import WEIGHTS_CHOICES, weights_files


@dataclass(frozen=True)
class TrainConfig:
    model: dict
    train: TrainSettings
    plan: Plan
    optimizer: OptimizerSettings = OptimizerSettings()
    data: DataSettings = DataSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: each reads different sequences."""
        accelerator = self.plan.accelerator
        return accelerator.dp_replicate_size * accelerator.dp_shard_size

    def with_steps(self, steps: int) -> "TrainConfig":
        return dataclasses.replace(self, train=dataclasses.replace(self.train, steps=steps))


def load_train_config(source: str | dict) -> TrainConfig:
    """Read and check a train config (a YAML path or a dict); errors name the field path."""
    raw = source if isinstance(source, dict) else read_yaml(source)
    if not isinstance(raw, dict):
        raise PlanError("<config>", f"must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    _reject_unknown_sections(raw)
    model = raw.pop("model", None)
    sections = {name: _section(name, raw.pop(name, None), cls) for name, cls in SECTIONS.items()}
    model = _check_model_section(model)
    plan = load_plan(raw)
    for name, size in plan.accelerator.not_with_cp():
        raise PlanError(f"accelerator.{name}", f"cpcompile train runs data, context and tensor parallelism, not "
                                               f"pipeline or expert parallelism; must be 1, got {size}")
    config = TrainConfig(model=model, plan=plan, **sections)
    _check_batch(config)
    if config.train.verify and config.dp_size > 1:
        raise PlanError("train.verify", "the unrewritten copy trains one replica's batch: verify needs "
                                        "dp_replicate_size = dp_shard_size = 1 (compare configs with "
                                        "`cpcompile compare` instead)")
    # model_config refuses a model type or key transformers does not know, before any process starts
    transformers_config = model_config(model)
    check_layer_count(config.train.ac_mode, transformers_config.get_text_config().num_hidden_layers)
    compiled = config.train.layer_compile_backend()
    if config.train.gdn_checkpoint_around_core and compiled is not None:
        # compiled, a checkpointed layer's replay is one backward graph: the inner checkpoints run
        # once in it and their saved tensors live across the core's backward, saving nothing
        raise PlanError("train.gdn_checkpoint_around_core", f"saves memory in eager layers only; the layers would be "
                                                            f"compiled ({compiled}): set train.compile_backend: eager")
    if config.train.gdn_checkpoint_around_core and plan.cp_size > 1:
        raise PlanError("train.gdn_checkpoint_around_core", f"is for GDN layers run outside CP; cp_size="
                                                            f"{plan.cp_size} rewrites them, and inner checkpoints "
                                                            "are not proven inside a CP rewrite yet")
    _check_tensor_parallel(config, transformers_config)
    if config.data.source != "synthetic":  # the tokenizer serves the model: said before any process starts
        tokenizer_for(config.data, transformers_config.get_text_config().vocab_size)
    return config


def _reject_unknown_sections(raw: dict) -> None:
    """A top-level key that is neither a trainer section nor a plan key, named with the trainer's
    allowed keys (the plan's check would name only its own two) and the closest one."""
    allowed = ("model", *SECTIONS, *TOP_LEVEL_KEYS)
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            name = key if isinstance(key, str) else short_repr(key)
            raise PlanError(name, f"unknown section; allowed: {', '.join(allowed)}{hint}")


def _check_tensor_parallel(config: TrainConfig, transformers_config) -> None:
    """What tp_size > 1 needs, said by field before any process starts: an SDPA model (no Gated
    DeltaNet layer, no GDN CP method) whose query and KV heads split evenly over tp, cp_size > 1
    (parallelize.py says why), and no dp_replicate (FSDP2 with TP over a dp_replicate x
    dp_shard_cp mesh: not yet)."""
    accelerator, plan = config.plan.accelerator, config.plan
    tp = accelerator.tp_size
    if tp == 1:
        return
    text = transformers_config.get_text_config()
    gdn_methods = [o for o in plan.overrides if o.method is not None and o.method.core == "gdn"]
    if "linear_attention" in (getattr(text, "layer_types", None) or ()) or gdn_methods:
        raise PlanError("accelerator.tp_size", f"is {tp} with a Gated DeltaNet model ({text.model_type}): TP+CP on "
                                               "GDN layers is out of scope (the GDN CP methods split or chain the "
                                               "recurrent state of the whole layer's heads); set tp_size: 1")
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, key, None)
        if heads is not None and heads % tp:
            raise PlanError("accelerator.tp_size", f"is {tp}, which does not divide the model's {key}={heads}: "
                                                   "tensor parallelism splits whole heads")
    if accelerator.cp_size == 1:
        raise PlanError("accelerator.tp_size", f"is {tp} with cp_size=1: the trainer's TP needs every attention "
                                               "rewritten for CP (cp_size > 1), where a replicated parameter applied "
                                               "to the TP-local heads (Qwen3's q_norm) gets its full gradient")
    if accelerator.dp_replicate_size > 1:
        raise PlanError("accelerator.dp_replicate_size", f"is {accelerator.dp_replicate_size} with tp_size={tp}: "
                                                         "FSDP2 with TP replicated over dp_replicate (HSDP + TP) is "
                                                         "not supported by the trainer yet; use dp_shard_size")


def _section(name: str, raw: Any, cls):
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise PlanError(name, f"must be a mapping, got {type(raw).__name__}")
    reject_unknown_keys(name, raw, tuple(f.name for f in fields(cls)))
    return cls(**raw)


def _check_model_section(model: Any) -> dict:
    """The model section with `weights` decided: a folder (`path`) loads its safetensors unless
    `weights: random` (a folder without them is refused, naming it: say `random` to mean it); a
    config (`model_type`) is random, and `weights` is not passed on to the transformers config."""
    if isinstance(model, dict) and "path" in model:
        reject_unknown_keys("model", model, ("path", "weights"))
        path = model["path"]
        if not isinstance(path, str) or not os.path.isfile(os.path.join(path, "config.json")):
            raise PlanError("model.path", f"must be a local folder holding config.json, got {short_repr(path)}")
        weights = model.get("weights", "pretrained")
        check_value("model.weights", weights, Literal[WEIGHTS_CHOICES])
        if weights == "pretrained":
            weights_files(path)  # the files are there and consistent; whether they fit the model: startup.py
        return {"path": path, "weights": weights}
    if not isinstance(model, dict) or not isinstance(model.get("model_type"), str):
        raise PlanError("model", "a mapping with model_type (a transformers model type), or with path (a local "
                                 "folder holding config.json), is required")
    model = dict(model)
    weights = model.pop("weights", "random")
    if weights != "random":
        raise PlanError("model.weights", f"is {short_repr(weights)} with model_type: a config alone has no weights; "
                                         "pretrained weights need model.path (a local Hugging Face folder)")
    return model


def pretrained_folder(model: dict) -> str | None:
    """The folder whose weights the run loads (`model.path` with `weights: pretrained`), else None."""
    return model["path"] if model.get("weights") == "pretrained" else None


def _check_batch(config: TrainConfig) -> None:
    """What `shard_batch` and the data loader would refuse at the first step, said here by field."""
    settings, plan = config.train, config.plan
    if settings.batch_size % config.dp_size:
        raise PlanError("train.batch_size", f"is the global batch: must be a multiple of the {config.dp_size} "
                                            f"data-parallel replicas, got {settings.batch_size}")
    layout = plan.layout()
    if layout is None:
        if plan.cp_size > 1:  # what `compile` refuses (CoverageError), said here before any process starts
            raise PlanError("plan_overrides", f"is empty with cp_size={plan.cp_size}: CP>1 needs an override "
                                              "naming the method of every attention (docs/plans.md)")
        return
    multiple = required_multiple(layout, plan.cp_size)
    if settings.seq_len % multiple:
        raise PlanError("train.seq_len", f"must be a multiple of {multiple} (the {layout} sequence layout over "
                                         f"cp_size={plan.cp_size}), got {settings.seq_len}")
