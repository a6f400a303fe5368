"""The trainer's YAML: what to train, on which mesh, with what data, optimizer and checkpoints.

One file holds the CP plan (`accelerator:`, `plan_overrides:`, as for `load_plan`) and these
sections (every key optional unless said; errors name the field path, e.g. `optimizer.warmup_steps`)::

    model:                      # a transformers config: AutoConfig.for_model(model_type, **rest)
      model_type: qwen3_5_text  #   (required, unless `path` is given)
      hidden_size: 64
    # or
    model:
      path: /models/my-model    # a local Hugging Face folder: config.json and its weights (model.safetensors,
                                # or shards + model.safetensors.index.json); nothing is downloaded
      weights: pretrained       # pretrained (with path; a folder without safetensors is refused) | random
                                # (seeded; with path: its config.json only). Loaded after TP, CP, AC and
                                # FSDP2, each rank reading its own slices (trainer/weights.py); not when
                                # the run resumes from a checkpoint
    train:
      steps: 10                 # optimizer steps
      seq_len: 256              # tokens per sequence (global, before CP sharding)
      batch_size: 2             # sequences per step over all data-parallel replicas (the global
                                # batch); a multiple of dp_replicate_size * dp_shard_size
      lr: 1.0e-3                # peak learning rate (AdamW)
      seed: 0                   # weights and data (the same on every rank)
      dtype: float32            # float32 | bfloat16 | float64: the parameters' dtype
      mixed_precision: null     # or {param_dtype: bfloat16, reduce_dtype: float32}: FSDP2 computes
                                # in param_dtype and reduces gradients in reduce_dtype
      grad_clip: null           # or a positive max global gradient norm
      activation_checkpointing: off   # off | every_layer | {every_n: k} | selective: which decoder layers
                                # run under torch.utils.checkpoint (non-reentrant): none, all, layers
                                # k, 2k, ... (from 1), or all with an op-level policy that keeps the
                                # matmul, attention / GDN core and collective outputs and recomputes
                                # the rest (trainer/activation_checkpointing.py)
      loss: chunked             # chunked: the head and cross-entropy a chunk of tokens at a time, never
                                # the [tokens, vocabulary] logits (trainer/lm_loss.py); full: the
                                # model's logits, then F.cross_entropy (for comparison)
      loss_chunk_tokens: 4096   # chunked: tokens per chunk; its logits [chunk, vocabulary] are the
                                # loss's largest tensors
      compile_backend: null     # torch.compile of each decoder layer (CP regions and checkpoint inside),
                                # and of the chunked loss's per-chunk elementwise work: a backend
                                # torch.compiler.list_backends knows (inductor, aot_eager);
                                # eager: not compiled; null: inductor on CUDA at cp 1, else eager
      gdn_backend: null         # eager | triton: run every GDN layer through cpcompile's own core,
                                # also where CP does not rewrite it (cp 1); null: transformers' path
      gdn_checkpoint_around_core: false  # true: each GDN layer run by gdn_backend puts the ops before its
                                # core (projections, conv, q/k L2 norm) and after it (gated norm,
                                # out_proj) under checkpoints of their own, so a layer's backward holds
                                # only the core's inputs and output of them (0.57B model: 170 -> 110 KB
                                # a token) for one more forward of those ops; eager layers only
                                # (compile_backend: eager), not with CP or selective checkpointing yet
      offload_layer_inputs: false  # true: the inputs the checkpointed layers keep (hidden size x 2 bytes
                                # a token each in bf16) wait in host memory, pinned on CUDA, until their
                                # backward (saved-tensor hooks that move that input alone, eager or
                                # compiled layers); needs every_layer or every_n
      sdpa_backend: null        # cudnn | flash | efficient | math: the one SDPA kernel the model's own
                                # attention calls (those CP does not rewrite: all of them at cp 1) run
                                # on, forward and backward; a call it refuses fails with PyTorch's
                                # reason (trainer/sdpa_backend.py); null: PyTorch chooses
      device: cpu               # cpu | cuda | npu
      dump_dir: null            # the rewritten graphs: <dump_dir>/rank<r> for each rank (one process: <dump_dir>)
      metrics_file: null        # one JSON line per step (rank 0)
      verify: false             # also train an unrewritten copy on the whole batch; judge each step
      verify_rtol: 1.0e-4       # verify, float32/float64: each step's CP loss within this relative
                                # difference of the copy's
      collective_timeout_s: 300 # every process group's collective timeout: a rank that waits longer
                                # (a peer stuck or gone) ends the run with one line naming the step
                                # and phase (trainer/progress.py)
    optimizer:                  # AdamW with linear warmup, then cosine decay (or constant)
      weight_decay: 0.01
      betas: [0.9, 0.999]
      eps: 1.0e-8
      warmup_steps: 0
      schedule: cosine          # cosine | constant (after the warmup)
      min_lr_ratio: 0.1         # cosine ends at lr * min_lr_ratio
    data:
      source: synthetic         # synthetic (random token ids) | text | jsonl | chat | prompt_completion
                                # (a local file; chat and prompt_completion: instruction data, the loss
                                # only on the assistant's / completion's tokens, chat.py says which)
      path: null                # text: documents separated by blank lines (UTF-8; a binary file is
                                # refused); the others: records, one JSON object a line, or the rows
                                # of a Parquet file when the path ends in .parquet (pyarrow). chat:
                                # `messages`, a list of {role, content}; prompt_completion: `prompt`
                                # and `completion` strings
      text_field: text          # jsonl: the key (Parquet: the column) holding a document
      tokenizer: null           # a local tokenizer folder (tokenizer.json / tokenizer_config.json,
                                # AutoTokenizer, no download): its EOS ends every document, its ids
                                # must fit model vocab_size; chat needs one (its chat template).
                                # null: UTF-8 bytes (ids 0..255, 256 ends a document)
      packing: false            # false: one document per row (padded / truncated); true: documents
                                # packed end to end into full rows, position ids restarting at 0 per
                                # document (synthetic: random document lengths); data.py says how
    checkpoint:
      folder: null              # DCP checkpoints: <folder>/step-<n>
      interval: 0               # save every `interval` steps (and after the last step run)
      resume: true              # start from the latest checkpoint in the folder, when there is one
      allow_changes: []         # fields a resume may change on purpose (e.g. [train.seq_len] for a
                                # curriculum); any other change of the data, seq_len, batch_size,
                                # seed, dtype, optimizer, schedule or model section is refused
                                # (trainer/resume_settings.py lists them)
      export: false             # at the end, write the last checkpoint as a Hugging Face folder to
                                # <folder>/hf (as `cpcompile export` does: trainer/export.py)

Mesh: `accelerator.dp_replicate_size` x `dp_shard_size` x `cp_size` x `tp_size` processes
(`cpcompile train --nproc-per-node N`, or torchrun); FSDP2 shards over `dp_shard x cp` and
replicates over `dp_replicate`. `tp_size > 1` (SDPA models, with cp_size > 1; not with
dp_replicate) splits every layer's heads and MLP over tp. PP and EP are refused.

The sections are dataclasses in `config_sections.py` (each checks its own fields, with the checks
of `field_checks.py`); `model:` is read by transformers in `hf_config.py`. Here the whole file is
loaded (`load_train_config`) and checked across sections and against the model.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, fields
from typing import Any

from ..errors import PlanError, short_repr
from ..plan import TOP_LEVEL_KEYS, Plan, load_plan
from ..sequence_layout import required_multiple
from ..yaml_input import read_yaml, reject_unknown_keys
from .activation_checkpointing import check_layer_count
from .config_sections import CheckpointSettings, DataSettings, OptimizerSettings, TrainSettings
from .field_checks import check_choice
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
        return dataclasses.replace(self, train=dataclasses.replace(self.train, steps=steps).validate())


SECTIONS = {"train": TrainSettings, "optimizer": OptimizerSettings, "data": DataSettings,
            "checkpoint": CheckpointSettings}


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
    compiled = config.train.layer_compile_backend(plan.cp_size)
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
    return cls(**raw).validate()


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
        check_choice("model.weights", weights, WEIGHTS_CHOICES)
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
