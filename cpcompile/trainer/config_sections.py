"""The trainer config's sections, each key declared once: `train:` (TrainSettings), `optimizer:`,
`data:` and `checkpoint:`, frozen dataclasses whose fields are the YAML keys, with their defaults,
their types (a closed choice is a `Literal`) and a docstring under each saying what it means.

Built, a section checks itself: each field by its type hint (`field_checks.Section`, one checker
for every section), then its checks across fields (`check_across`). The checks across sections
and against the model run in `config.load_train_config`. `python -m cpcompile config-reference`
prints every key with its default and docstring (`config_reference.py`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, TypedDict, Union, get_args

import torch

from ..errors import PlanError, short_repr
from .activation_checkpointing import ACMode, parse_ac_mode
from .field_checks import (
    Count, Positive, Rule, Section, Size, check_compile_backend, check_optional_string, check_text_file, in_range,
)
from .records import check_parquet_file, is_parquet
from .resume_settings import FIELDS as TRAJECTORY_FIELDS
from .sdpa_backend import SDPA_BACKENDS, SDPABackendName
from .tokenizer import check_tokenizer_folder

DType = Literal["float32", "bfloat16", "float64"]
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in get_args(DType)}
Device = Literal["cpu", "cuda", "npu"]
LossMode = Literal["chunked", "full"]
GDNBackend = Literal["eager", "triton"]
Schedule = Literal["cosine", "constant"]
DataSource = Literal["synthetic", "text", "jsonl", "chat", "prompt_completion"]
ResumeField = Literal[TRAJECTORY_FIELDS]
Beta = Annotated[float, in_range("a number in [0, 1)", low=0.0, below=1.0)]
ACSetting = Annotated[Union[str, bool, dict], Rule(lambda field, value: parse_ac_mode(value),
                                                   "off, every_layer, selective or {every_n: k}")]
EAGER = "eager"  # train.compile_backend: eager runs the decoder layers uncompiled, whatever the default
# train.compile_backend when the config leaves it null, per device, with or without CP: inductor on
# CUDA. Without CP (one H200, the 0.57B model at 32K tokens: 35.3K tokens/s against eager's 24.6K,
# docs/trainer.md); with CP, on one H100 under the fake process group, CP=2 at 32K tokens a rank:
# rank 0 0.753 s against 1.54 eager, the last rank 1.249 against 1.848 (lower peaks too), compiled
# layers holding CP regions proven equal to eager CP on CPU (gloo), not yet run over NCCL
# (benchmarks/results/compiled_cp_2026-12-06_NVIDIA-H100.md). `eager` stays eager whatever this says.
DEFAULT_COMPILE_BACKENDS: dict[str, str] = {"cpu": EAGER, "cuda": "inductor", "npu": EAGER}


def check_backend_name(field: str, value: str) -> None:
    """`eager`, or a backend this torch's `torch.compile` knows (said here, not at the first compile)."""
    check_optional_string(field, value)
    if value != EAGER:
        check_compile_backend(field, value)


CompileBackend = Annotated[str, Rule(check_backend_name, "a torch.compile backend (inductor, aot_eager, ...) "
                                                         "or eager")]


class MixedPrecision(TypedDict, total=False):
    """`train.mixed_precision`: FSDP2's MixedPrecisionPolicy (a dtype left out: FSDP2's default)."""

    param_dtype: DType | None
    reduce_dtype: DType | None


@dataclass(frozen=True)
class TrainSettings(Section):
    """What to train, how long, on which device, and what the run writes."""

    NAME: ClassVar[str] = "train"
    steps: Size = 10
    """Optimizer steps."""
    seq_len: Size = 256
    """Tokens per sequence (global, before CP sharding)."""
    batch_size: Size = 2
    """Sequences per step over all data-parallel replicas (the global batch): a multiple of
    dp_replicate_size * dp_shard_size."""
    lr: Positive = 1e-3
    """Peak learning rate (AdamW)."""
    seed: int = 0
    """Seeds the weights and the data (the same on every rank)."""
    dtype: DType = "float32"
    """The parameters' dtype."""
    mixed_precision: MixedPrecision | None = None
    """{param_dtype: bfloat16, reduce_dtype: float32}: FSDP2 computes in param_dtype and reduces
    gradients in reduce_dtype; null: in `dtype`."""
    grad_clip: Positive | None = None
    """The largest global gradient norm; null: no clipping."""
    activation_checkpointing: ACSetting = "off"
    """Which decoder layers run under torch.utils.checkpoint (non-reentrant): off (none),
    every_layer (all), {every_n: k} (layers k, 2k, ..., from 1), or selective (all, with an
    op-level policy that keeps the matmul, attention / GDN core and collective outputs and
    recomputes the rest; trainer/activation_checkpointing.py)."""
    loss: LossMode = "chunked"
    """chunked: the head and cross-entropy a chunk of tokens at a time, never the [tokens, vocabulary]
    logits (trainer/lm_loss.py); full: the model's logits, then F.cross_entropy (for comparison)."""
    loss_chunk_tokens: Size = 4096
    """chunked: tokens per chunk; its logits [chunk, vocabulary] are the loss's largest tensors."""
    compile_backend: CompileBackend | None = None
    """torch.compile of each decoder layer (CP regions and checkpoint inside) and of the chunked
    loss's per-chunk elementwise work: a backend torch.compiler.list_backends knows (inductor,
    aot_eager); eager: not compiled; null: inductor on CUDA, else eager."""
    gdn_backend: GDNBackend | None = None
    """Run every GDN layer through cpcompile's own core, also where CP does not rewrite it (cp 1);
    null: transformers' path."""
    gdn_checkpoint_around_core: bool = False
    """Each GDN layer run by gdn_backend puts the ops before its core (projections, conv, q/k L2
    norm) and after it (gated norm, out_proj) under checkpoints of their own, so a layer's backward
    holds only the core's inputs and output of them (0.57B model: 170 -> 110 KB a token) for one more
    forward of those ops; eager layers only (compile_backend: eager), not with CP or selective
    checkpointing yet."""
    offload_layer_inputs: bool = False
    """The inputs the checkpointed layers keep (hidden size x 2 bytes a token each in bf16) wait in
    host memory, pinned on CUDA, until their backward (saved-tensor hooks that move that input alone,
    eager or compiled layers); needs activation_checkpointing every_layer or {every_n: k}."""
    sdpa_backend: SDPABackendName | None = None
    """The one SDPA kernel the model's own attention calls run on, forward and backward; a call it
    refuses fails with PyTorch's reason (trainer/sdpa_backend.py). Set, it keeps transformers' SDPA
    path at cp 1 (with the dense mask transformers builds for padded or packed batches); null: at
    cp 1 the CP regions' local kernels run the attention (adapters/hf_attention.py)."""
    device: Device = "cpu"
    """Where the model runs."""
    dump_dir: str | None = None
    """The rewritten graphs: <dump_dir>/rank<r> for each rank (one process: <dump_dir>)."""
    metrics_file: str | None = None
    """One JSON line per step (rank 0)."""
    verify: bool = False
    """Also train an unrewritten copy on the whole batch, and judge each step against it."""
    verify_rtol: Positive = 1e-4
    """With verify, float32/float64: each step's CP loss within this relative difference of the copy's."""
    collective_timeout_s: Positive = 300.0
    """Every process group's collective timeout: a rank that waits longer (a peer stuck or gone)
    ends the run with one line naming the step and phase (trainer/progress.py)."""

    def check_across(self) -> None:
        if self.gdn_checkpoint_around_core and self.gdn_backend is None:
            raise PlanError("train.gdn_checkpoint_around_core", "needs train.gdn_backend (eager or triton): it "
                                                                 "applies to the GDN layers cpcompile runs")
        if self.gdn_checkpoint_around_core and self.ac_mode.kind == "selective":
            raise PlanError("train.gdn_checkpoint_around_core", "not with activation_checkpointing: selective (its "
                                                                 "policy would also rule the inner checkpoints)")
        if self.offload_layer_inputs and self.ac_mode.kind not in ("every_layer", "every_n"):
            raise PlanError("train.offload_layer_inputs", f"moves the inputs checkpointed layers keep; needs "
                                                          f"activation_checkpointing every_layer or {{every_n: k}}, "
                                                          f"got {short_repr(self.activation_checkpointing)}")
        if self.sdpa_backend is not None and self.device not in SDPA_BACKENDS[self.sdpa_backend][1]:
            devices = SDPA_BACKENDS[self.sdpa_backend][1]
            raise PlanError("train.sdpa_backend", f"{self.sdpa_backend!r} has no kernel on {self.device} "
                                                  f"(runs on {', '.join(devices)})")

    @property
    def ac_mode(self) -> ACMode:
        return parse_ac_mode(self.activation_checkpointing)

    def layer_compile_backend(self) -> str | None:
        """The `torch.compile` backend of the decoder layers, None to run them eagerly:
        `compile_backend`, or when it is null the device's default, with CP or without."""
        backend = self.compile_backend if self.compile_backend is not None else DEFAULT_COMPILE_BACKENDS[self.device]
        return None if backend == EAGER else backend

    def loss_compile_backend(self) -> str | None:
        """The backend the chunked loss compiles its chunk work with: the layers' (None: eager)."""
        return self.layer_compile_backend() if self.loss == "chunked" else None

    def precision_policy(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(param_dtype, reduce_dtype) for FSDP2's MixedPrecisionPolicy; (None, None) without one."""
        chosen = self.mixed_precision or {}
        param, reduce = (chosen.get(key) for key in ("param_dtype", "reduce_dtype"))
        return (DTYPES[param] if param else None), (DTYPES[reduce] if reduce else None)


@dataclass(frozen=True)
class OptimizerSettings(Section):
    """AdamW with a linear warmup, then cosine decay (or a constant rate)."""

    NAME: ClassVar[str] = "optimizer"
    weight_decay: Annotated[float, in_range("a number >= 0", low=0.0)] = 0.01
    """AdamW's decoupled weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW's moment decay rates."""
    eps: Positive = 1e-8
    """AdamW's epsilon."""
    warmup_steps: Count = 0
    """Steps of linear warmup, from lr / warmup_steps up to lr."""
    schedule: Schedule = "cosine"
    """After the warmup: cosine decay down to lr * min_lr_ratio at the last step, or constant."""
    min_lr_ratio: Annotated[float, in_range("a number in [0, 1]", low=0.0, high=1.0)] = 0.1
    """Where cosine ends: lr * min_lr_ratio."""


@dataclass(frozen=True)
class DataSettings(Section):
    """The training text: synthetic token ids, or a local file's documents (docs/trainer.md)."""

    NAME: ClassVar[str] = "data"
    source: DataSource = "synthetic"
    """synthetic: random token ids; the others read a local file. chat and prompt_completion are
    instruction data, the loss only on the assistant's / completion's tokens (chat.py says which)."""
    path: str | None = None
    """text: documents separated by blank lines (UTF-8; a binary file is refused); the others:
    records, one JSON object a line, or the rows of a Parquet file when the path ends in .parquet
    (pyarrow). chat: `messages`, a list of {role, content}; prompt_completion: `prompt` and
    `completion` strings."""
    text_field: str = "text"
    """jsonl: the key (Parquet: the column) holding a document."""
    packing: bool = False
    """false: one document per row (padded / truncated); true: documents packed end to end into full
    rows, position ids restarting at 0 per document (synthetic: random document lengths); data.py
    says how."""
    tokenizer: str | None = None
    """A local tokenizer folder (tokenizer.json / tokenizer_config.json, AutoTokenizer, no download):
    its EOS ends every document, its ids must fit the model's vocab_size; chat needs one (its chat
    template). null: UTF-8 bytes (ids 0..255, 256 ends a document)."""

    def check_across(self) -> None:
        if self.source == "synthetic":
            if self.path is not None:
                raise PlanError("data.path", "synthetic data reads no file: leave path out, or set data.source")
            if self.tokenizer is not None:
                raise PlanError("data.tokenizer", "synthetic data tokenizes nothing: leave tokenizer out, or set "
                                                  "data.source")
            return
        self._check_path()
        if self.tokenizer is not None:
            check_tokenizer_folder(self.tokenizer)
        elif self.source == "chat":
            raise PlanError("data.tokenizer", "data.source chat renders each conversation with a tokenizer's chat "
                                              "template: set data.tokenizer to a local tokenizer folder")

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
class CheckpointSettings(Section):
    """DCP checkpoints of the whole run state, resume, and export (docs/trainer.md)."""

    NAME: ClassVar[str] = "checkpoint"
    folder: str | None = None
    """Where checkpoints go: <folder>/step-<n>; null: none saved."""
    interval: Count = 0
    """Save every `interval` steps (and after the last step run); 0: after the last step run only."""
    resume: bool = True
    """Start from the latest checkpoint in the folder, when there is one."""
    export: bool = False
    """At the end, write the last checkpoint as a Hugging Face folder to <folder>/hf (as `cpcompile
    export` does: trainer/export.py)."""
    allow_changes: tuple[ResumeField, ...] = ()
    """Fields a resume may change on purpose (e.g. [train.seq_len] for a curriculum); any other
    change of the data, seq_len, batch_size, seed, dtype, optimizer, schedule or model section is
    refused (trainer/resume_settings.py lists them)."""

    def check_across(self) -> None:
        if self.interval and self.folder is None:
            raise PlanError("checkpoint.interval", "saving every few steps needs checkpoint.folder")
        if self.export and self.folder is None:
            raise PlanError("checkpoint.export", "exports the last checkpoint to <checkpoint.folder>/hf: needs "
                                                 "checkpoint.folder")


# The sections by their YAML key, in the order the reference lists them.
SECTIONS = {cls.NAME: cls for cls in (TrainSettings, OptimizerSettings, DataSettings, CheckpointSettings)}
