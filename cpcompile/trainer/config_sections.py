"""The trainer config's sections as frozen dataclasses, one field per YAML key (`config.py`'s
docstring shows the YAML and says what each key does): `train:` (TrainSettings), `optimizer:`,
`data:`, `checkpoint:`, with the closed choices they take. Each section's `validate` checks its
own fields; the checks across sections and against the model run in `config.load_train_config`."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PlanError, short_repr
from ..yaml_input import check_size, reject_unknown_keys
from .activation_checkpointing import ACMode, parse_ac_mode
from .field_checks import (
    check_bool, check_choice, check_compile_backend, check_number, check_optional_string, check_positive_number,
    check_text_file,
)
from .records import check_parquet_file, is_parquet
from .resume_settings import FIELDS as TRAJECTORY_FIELDS
from .sdpa_backend import SDPA_BACKENDS
from .tokenizer import check_tokenizer_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
LOSS_MODES = ("chunked", "full")
SCHEDULES = ("cosine", "constant")
DATA_SOURCES = ("synthetic", "text", "jsonl", "chat", "prompt_completion")
GDN_BACKENDS = ("eager", "triton")
EAGER = "eager"  # train.compile_backend: eager runs the decoder layers uncompiled, whatever the default
# train.compile_backend when the config leaves it null, per device, without CP: inductor on CUDA (one
# H200, the 0.57B model at 32K tokens: 35.3K tokens/s against eager's 24.6K, docs/trainer.md). With
# CP (cp_size > 1) null means eager on every device: compiled layers holding CP regions are proven on
# CPU (aot_eager, gloo) but have not run over NCCL yet. `eager` stays eager whatever this says.
DEFAULT_COMPILE_BACKENDS: dict[str, str] = {"cpu": EAGER, "cuda": "inductor", "npu": EAGER}


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 10
    seq_len: int = 256
    batch_size: int = 2
    lr: float = 1e-3
    seed: int = 0
    dtype: str = "float32"
    mixed_precision: dict | None = None
    grad_clip: float | None = None
    activation_checkpointing: Any = "off"  # a mode name or {every_n: k}: `ac_mode` reads it
    loss: str = "chunked"
    loss_chunk_tokens: int = 4096
    compile_backend: str | None = None
    gdn_backend: str | None = None
    gdn_checkpoint_around_core: bool = False
    offload_layer_inputs: bool = False
    sdpa_backend: str | None = None
    device: str = "cpu"
    dump_dir: str | None = None
    metrics_file: str | None = None
    verify: bool = False
    verify_rtol: float = 1e-4
    collective_timeout_s: float = 300.0

    def validate(self) -> "TrainSettings":
        for name in ("steps", "seq_len", "batch_size", "loss_chunk_tokens"):
            check_size(f"train.{name}", getattr(self, name))
        check_positive_number("train.lr", self.lr)
        check_positive_number("train.verify_rtol", self.verify_rtol)
        check_positive_number("train.collective_timeout_s", self.collective_timeout_s)
        if self.grad_clip is not None:
            check_positive_number("train.grad_clip", self.grad_clip)
        if type(self.seed) is not int:
            raise PlanError("train.seed", f"must be an integer, got {short_repr(self.seed)}")
        check_choice("train.dtype", self.dtype, DTYPES)
        parse_ac_mode(self.activation_checkpointing)
        check_choice("train.loss", self.loss, LOSS_MODES)
        if self.gdn_backend is not None:
            check_choice("train.gdn_backend", self.gdn_backend, GDN_BACKENDS)
        check_choice("train.device", self.device, ("cpu", "cuda", "npu"))
        for name in ("compile_backend", "dump_dir", "metrics_file"):
            check_optional_string(f"train.{name}", getattr(self, name))
        if self.compile_backend not in (None, EAGER):
            check_compile_backend("train.compile_backend", self.compile_backend)
        check_bool("train.verify", self.verify)
        check_bool("train.gdn_checkpoint_around_core", self.gdn_checkpoint_around_core)
        if self.gdn_checkpoint_around_core and self.gdn_backend is None:
            raise PlanError("train.gdn_checkpoint_around_core", "needs train.gdn_backend (eager or triton): it "
                                                                 "applies to the GDN layers cpcompile runs")
        if self.gdn_checkpoint_around_core and self.ac_mode.kind == "selective":
            raise PlanError("train.gdn_checkpoint_around_core", "not with activation_checkpointing: selective (its "
                                                                 "policy would also rule the inner checkpoints)")
        check_bool("train.offload_layer_inputs", self.offload_layer_inputs)
        if self.offload_layer_inputs and self.ac_mode.kind not in ("every_layer", "every_n"):
            raise PlanError("train.offload_layer_inputs", f"moves the inputs checkpointed layers keep; needs "
                                                          f"activation_checkpointing every_layer or {{every_n: k}}, "
                                                          f"got {short_repr(self.activation_checkpointing)}")
        self._check_sdpa_backend()
        self.precision_policy()
        return self

    def _check_sdpa_backend(self) -> None:
        if self.sdpa_backend is None:
            return
        check_choice("train.sdpa_backend", self.sdpa_backend, SDPA_BACKENDS)
        devices = SDPA_BACKENDS[self.sdpa_backend][1]
        if self.device not in devices:
            raise PlanError("train.sdpa_backend", f"{self.sdpa_backend!r} has no kernel on {self.device} "
                                                  f"(runs on {', '.join(devices)})")

    @property
    def ac_mode(self) -> ACMode:
        return parse_ac_mode(self.activation_checkpointing)

    def layer_compile_backend(self, cp_size: int) -> str | None:
        """The `torch.compile` backend of the decoder layers, None to run them eagerly:
        `compile_backend`, or when it is null the device's default without CP, eager with it."""
        backend = self.compile_backend
        if backend is None:
            backend = DEFAULT_COMPILE_BACKENDS[self.device] if cp_size == 1 else EAGER
        return None if backend == EAGER else backend

    def loss_compile_backend(self, cp_size: int) -> str | None:
        """The backend the chunked loss compiles its chunk work with: the layers' (None: eager)."""
        return self.layer_compile_backend(cp_size) if self.loss == "chunked" else None

    def precision_policy(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(param_dtype, reduce_dtype) for FSDP2's MixedPrecisionPolicy; (None, None) without one."""
        if self.mixed_precision is None:
            return None, None
        if not isinstance(self.mixed_precision, dict):
            raise PlanError("train.mixed_precision", f"must be a mapping or null, got {short_repr(self.mixed_precision)}")
        reject_unknown_keys("train.mixed_precision", self.mixed_precision, ("param_dtype", "reduce_dtype"))
        chosen = []
        for key in ("param_dtype", "reduce_dtype"):
            name = self.mixed_precision.get(key)
            if name is not None:
                check_choice(f"train.mixed_precision.{key}", name, DTYPES)
            chosen.append(DTYPES[name] if name is not None else None)
        return chosen[0], chosen[1]


@dataclass(frozen=True)
class OptimizerSettings:
    weight_decay: float = 0.01
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1

    def validate(self) -> "OptimizerSettings":
        check_number("optimizer.weight_decay", self.weight_decay, low=0.0)
        check_positive_number("optimizer.eps", self.eps)
        betas = self.betas
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise PlanError("optimizer.betas", f"must be a list of two numbers in [0, 1), got {short_repr(betas)}")
        for i, beta in enumerate(betas):
            check_number(f"optimizer.betas[{i}]", beta, low=0.0, below=1.0)
        if type(self.warmup_steps) is not int or self.warmup_steps < 0:
            raise PlanError("optimizer.warmup_steps", f"must be an integer >= 0, got {short_repr(self.warmup_steps)}")
        check_choice("optimizer.schedule", self.schedule, SCHEDULES)
        check_number("optimizer.min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        return dataclasses.replace(self, betas=tuple(float(b) for b in betas))


@dataclass(frozen=True)
class DataSettings:
    source: str = "synthetic"
    path: str | None = None
    text_field: str = "text"
    packing: bool = False
    tokenizer: str | None = None

    def validate(self) -> "DataSettings":
        check_choice("data.source", self.source, DATA_SOURCES)
        check_bool("data.packing", self.packing)
        for name in ("path", "text_field", "tokenizer"):
            check_optional_string(f"data.{name}", getattr(self, name))
        if self.source == "synthetic":
            if self.path is not None:
                raise PlanError("data.path", "synthetic data reads no file: leave path out, or set data.source")
            if self.tokenizer is not None:
                raise PlanError("data.tokenizer", "synthetic data tokenizes nothing: leave tokenizer out, or set "
                                                  "data.source")
            return self
        self._check_path()
        if self.tokenizer is not None:
            check_tokenizer_folder(self.tokenizer)
        elif self.source == "chat":
            raise PlanError("data.tokenizer", "data.source chat renders each conversation with a tokenizer's chat "
                                              "template: set data.tokenizer to a local tokenizer folder")
        return self

    def _check_path(self) -> None:
        if self.path is None:
            raise PlanError("data.path", f"data.source {self.source} needs the path of a local file")
        if not os.path.isfile(self.path):
            raise PlanError("data.path", f"no such file: {short_repr(self.path)}")
        if not is_parquet(self.path):
            check_text_file("data.path", self.path)
        elif self.source == "text":
            raise PlanError("data.source", f"text reads a plain text file, not the Parquet file "
                                           f"{short_repr(self.path)}: a Parquet text column is data.source jsonl "
                                           "(with data.text_field)")
        else:
            check_parquet_file("data.path", self.path)


@dataclass(frozen=True)
class CheckpointSettings:
    folder: str | None = None
    interval: int = 0
    resume: bool = True
    export: bool = False
    allow_changes: tuple = ()

    def validate(self) -> "CheckpointSettings":
        check_optional_string("checkpoint.folder", self.folder)
        if type(self.interval) is not int or self.interval < 0:
            raise PlanError("checkpoint.interval", f"must be an integer >= 0, got {short_repr(self.interval)}")
        if self.interval and self.folder is None:
            raise PlanError("checkpoint.interval", "saving every few steps needs checkpoint.folder")
        check_bool("checkpoint.resume", self.resume)
        check_bool("checkpoint.export", self.export)
        allowed = self.allow_changes
        if not isinstance(allowed, (list, tuple)):
            raise PlanError("checkpoint.allow_changes", f"must be a list of field paths, got {short_repr(allowed)}")
        for i, name in enumerate(allowed):
            if name not in TRAJECTORY_FIELDS:
                raise PlanError(f"checkpoint.allow_changes[{i}]", f"{short_repr(name)} is not a setting a resume "
                                                                  f"checks; one of: {', '.join(TRAJECTORY_FIELDS)}")
        if self.export and self.folder is None:
            raise PlanError("checkpoint.export", "exports the last checkpoint to <checkpoint.folder>/hf: needs "
                                                 "checkpoint.folder")
        return dataclasses.replace(self, allow_changes=tuple(allowed))
