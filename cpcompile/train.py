"""`cpcompile train CONFIG.yaml`: train a Hugging Face causal LM, built from a config with random
weights, with the context parallelism the config's plan declares; launch it with `torchrun`
(`--nproc-per-node` = `cp_size`). It needs transformers: `pip install "cpcompile[train]"`.

The YAML holds the plan (`accelerator:`, `plan_overrides:`, as for `load_plan`) and two more
sections::

    model:                      # a transformers config: AutoConfig.for_model(model_type, **rest)
      model_type: qwen3_5_text
      hidden_size: 64
      ...
    train:
      steps: 10                 # optimizer steps
      seq_len: 256              # tokens per sequence (global, before CP sharding); a multiple of
                                # cp_size (2 * cp_size for Head-Tail)
      batch_size: 2
      lr: 1.0e-3                # AdamW
      seed: 0                   # weights and the synthetic token stream (same on every rank)
      dtype: float32            # float32 | bfloat16 | float64
      device: cpu               # cpu | cuda | npu
      compile_backend: null     # or a torch.compile backend (aot_eager, inductor)
      dump_dir: null            # the rewritten graphs, one folder per rank: <dump_dir>/rank<r>
      verify: false             # also train an unrewritten copy on the whole batch; judge each step
      verify_rtol: 1.0e-4       # verify, float32/float64: each step's CP loss within this relative
                                # difference of the copy's

Every key of `model:` must be one its transformers config class has (a misspelt key would be
kept by transformers and used by nothing). Data are random token ids (no dataset is downloaded).
Every step: `shard_batch` of the global batch, forward/backward of this rank's slice, gradients
summed over the CP group, AdamW step; rank 0 prints the global mean loss. Only CP is run here:
data/tensor/pipeline-parallel sizes must be 1.

`verify: true` judges every step and stops at the first that fails with a `VerificationError`
(the CLI prints one `FAIL:` line and exits with status 1). In float32/float64 the CP loss must be
within `verify_rtol` of the copy's. In bfloat16 a fixed bound cannot tell CP from rounding
(`parity.py`), so a third copy trains in float32 and the CP loss's difference from it must be at
most 1.5 times the bfloat16 copy's, plus 1e-3.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import time
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
import torch.distributed as dist

from .batch import required_multiple, shard_batch
from .dump import prepare_dump_dir
from .errors import CPConfigError, MissingDependencyError, PlanError, VerificationError, short_repr
from .pipeline import compile as cp_compile
from .loss import all_reduce_gradients
from .mesh import build_mesh
from .parity import FACTOR, FLOOR, within_precision
from .plan import Plan, check_size, load_plan, read_yaml, reject_unknown_keys

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 10
    seq_len: int = 256
    batch_size: int = 2
    lr: float = 1e-3
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    compile_backend: str | None = None
    dump_dir: str | None = None
    verify: bool = False
    verify_rtol: float = 1e-4

    def validate(self) -> "TrainSettings":
        for name in ("steps", "seq_len", "batch_size"):
            check_size(f"train.{name}", getattr(self, name))
        _check_positive_number("train.lr", self.lr)
        _check_positive_number("train.verify_rtol", self.verify_rtol)
        if type(self.seed) is not int:
            raise PlanError("train.seed", f"must be an integer, got {short_repr(self.seed)}")
        if self.dtype not in DTYPES:
            raise PlanError("train.dtype", f"must be one of {sorted(DTYPES)}, got {short_repr(self.dtype)}")
        if self.device not in ("cpu", "cuda", "npu"):
            raise PlanError("train.device", f"must be cpu, cuda or npu, got {short_repr(self.device)}")
        for name in ("compile_backend", "dump_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise PlanError(f"train.{name}", f"must be a non-empty string or null, got {short_repr(value)}")
        if not isinstance(self.verify, bool):
            raise PlanError("train.verify", f"must be true or false, got {short_repr(self.verify)}")
        return self


def _check_positive_number(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        hint = " (YAML reads 1e-3 as a string: write 1.0e-3)" if isinstance(value, str) else ""
        raise PlanError(field, f"must be a positive number, got {short_repr(value)}{hint}")


@dataclass(frozen=True)
class TrainConfig:
    model: dict
    train: TrainSettings
    plan: Plan


def load_train_config(source: str | dict) -> TrainConfig:
    """Read and check a train config (a YAML path or a dict); errors name the field path."""
    raw = source if isinstance(source, dict) else read_yaml(source)
    if not isinstance(raw, dict):
        raise PlanError("<config>", f"must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    model, settings = raw.pop("model", None), raw.pop("train", None) or {}
    if not isinstance(model, dict) or not isinstance(model.get("model_type"), str):
        raise PlanError("model", "a mapping with model_type (a transformers model type) is required")
    if not isinstance(settings, dict):
        raise PlanError("train", f"must be a mapping, got {type(settings).__name__}")
    reject_unknown_keys("train", settings, tuple(f.name for f in fields(TrainSettings)))
    plan = load_plan(raw)
    for name, size in plan.accelerator.not_with_cp(include_dp=True):
        raise PlanError(f"accelerator.{name}", f"cpcompile train runs context parallelism only; must be 1, "
                                               f"got {size} (use the library API for other parallelisms)")
    settings = TrainSettings(**settings).validate()
    _check_seq_len(settings, plan)
    model_config(model)  # refuses a model type or key transformers does not know, before any process starts
    return TrainConfig(dict(model), settings, plan)


def _check_seq_len(settings: TrainSettings, plan: Plan) -> None:
    """`shard_batch` would refuse the batch at the first step; say it here, naming the field."""
    layout = plan.layout()
    if layout is None:
        return
    multiple = required_multiple(layout, plan.cp_size)
    if settings.seq_len % multiple:
        raise PlanError("train.seq_len", f"must be a multiple of {multiple} (the {layout} sequence layout over "
                                         f"cp_size={plan.cp_size}), got {settings.seq_len}")


def transformers_module():
    """transformers, or a `MissingDependencyError` naming the extra that installs it."""
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            f"cpcompile train and bench build Hugging Face models and need transformers, which cannot be "
            f"imported ({exc}): pip install \"cpcompile[train]\""
        ) from exc
    return transformers


def model_config(raw: dict):
    """The transformers config `model:` describes (`AutoConfig.for_model(model_type, **rest)`).

    A `PlanError` naming the key for a model type transformers does not know, and for a key its
    config class does not have: transformers keeps such a key as a stray attribute that no model
    reads, so a misspelt `hidden_sise` would silently train the default size. Keys transformers
    still converts (e.g. `rope_theta` into `rope_parameters`) are not kept, and pass."""
    transformers = transformers_module()
    kwargs = dict(raw)
    model_type = kwargs.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise PlanError("model.model_type", f"{short_repr(model_type)} is not a model type transformers "
                                            f"{transformers.__version__} knows")
    config_class = transformers.CONFIG_MAPPING[model_type]
    try:
        config = config_class(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PlanError("model", f"transformers refused this {config_class.__name__}: {exc}") from exc
    known = _config_keys(config_class)
    for key in kwargs:
        if key not in known and key in vars(config):
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PlanError(f"model.{key}", f"{config_class.__name__} ({model_type}) has no such key, so no "
                                            f"model would read it{hint}")
    return config


def _config_keys(config_class) -> set[str]:
    """Every key a transformers config class declares: its fields (dataclass configs), the
    parameters of its and its bases' `__init__`, and its attribute aliases."""
    keys = set(getattr(config_class, "attribute_map", {}))
    if dataclasses.is_dataclass(config_class):
        keys |= {f.name for f in dataclasses.fields(config_class)}
    for klass in config_class.__mro__:
        if "__init__" in vars(klass):
            keys |= set(inspect.signature(klass.__init__).parameters)
    return keys


def build_model(raw_model_config: dict, settings: TrainSettings) -> torch.nn.Module:
    """The same randomly initialised causal LM on every rank (seeded), SDPA attention."""
    transformers = transformers_module()
    config = model_config(raw_model_config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(settings.seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=settings.device, dtype=DTYPES[settings.dtype])


def synthetic_batch(step: int, settings: TrainSettings, vocab_size: int) -> dict:
    """Random token ids, identical on every rank for a given step (the CP batch contract)."""
    gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    ids = torch.randint(0, vocab_size, (settings.batch_size, settings.seq_len), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return {k: v.to(settings.device) for k, v in batch.items()}


def check_world_size(plan: Plan) -> None:
    """One process per CP rank: say how to launch when the job has another number of processes."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.accelerator.world_size:
        raise PlanError("accelerator.cp_size", f"is {plan.cp_size} but the job has {world} process(es); launch "
                                               f"one per CP rank: torchrun --nproc-per-node {plan.cp_size} ...")


def rank_dump_dir(dump_dir: str | None, rank: int) -> str | None:
    """`<dump_dir>/rank<r>`, created now: a folder that cannot be written is an error naming the field."""
    if dump_dir is None:
        return None
    path = os.path.join(dump_dir, f"rank{rank}")
    try:
        prepare_dump_dir(path)
    except CPConfigError as exc:
        raise PlanError("train.dump_dir", str(exc)) from exc
    return path


def train(config: TrainConfig, log: Callable[[str], None] = print) -> list[dict]:
    """Run the loop; -> one record per step: {"step", "loss", "seconds"}, with `verify` also
    "reference_loss" (and "fp32_reference_loss" in bfloat16). Call inside an initialised process
    group of `cp_size` ranks (torchrun), or let `build_mesh` make one. With `verify`, a step whose
    CP loss is off its reference raises `VerificationError` on every rank."""
    settings = config.train
    check_world_size(config.plan)
    mesh = build_mesh(config.plan.accelerator, device_type=settings.device)
    dump = rank_dump_dir(settings.dump_dir, mesh.cp_rank)
    model = build_model(config.model, settings)
    references = _references(config.model, settings)
    vocab = model.config.get_text_config().vocab_size
    first = shard_batch(synthetic_batch(0, settings, vocab), mesh, config.plan)
    cp_compile(model, mesh, config.plan, dump_dir=dump, example_inputs=first)
    runner = torch.compile(model, backend=settings.compile_backend) if settings.compile_backend else model
    optimizers = [torch.optim.AdamW(m.parameters(), lr=settings.lr) for m in (model, *references.values())]
    records = []
    for step in range(settings.steps):
        start = time.perf_counter()
        batch = synthetic_batch(step, settings, vocab)
        out = runner(**shard_batch(batch, mesh, config.plan))
        out.loss.backward()
        all_reduce_gradients(model, mesh)
        loss = out.loss.detach().float()
        dist.all_reduce(loss, group=mesh.cp_group)  # rank shares sum to the global mean
        record = {"step": step + 1, "loss": loss.item(), "seconds": time.perf_counter() - start}
        for name, reference in references.items():
            ref_loss = reference(**batch, use_cache=False).loss
            ref_loss.backward()
            record[f"{name}_loss"] = ref_loss.item()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        records.append(record)
        if mesh.cp_rank == 0:
            log(_format(record, settings.steps, mesh.cp_size))
        if settings.verify:
            _verify(record, settings, mesh)
    if settings.verify and mesh.cp_rank == 0:
        log(f"verify: PASS: {_tolerance(settings)}, every step of {settings.steps}")
    return records


def _references(raw_model_config: dict, settings: TrainSettings) -> dict[str, torch.nn.Module]:
    """The unrewritten copies `verify` trains on the whole batch: one in the run's dtype, and in
    bfloat16 one more in float32 to judge both against (same seed, so the same initial weights)."""
    if not settings.verify:
        return {}
    references = {"reference": build_model(raw_model_config, settings)}
    if settings.dtype == "bfloat16":
        references["fp32_reference"] = build_model(raw_model_config, dataclasses.replace(settings, dtype="float32"))
    return references


def _tolerance(settings: TrainSettings) -> str:
    if settings.dtype == "bfloat16":
        return (f"the bfloat16 CP loss within {FACTOR:g}x the bfloat16 copy's difference from the float32 copy "
                f"+ {FLOOR:g}")
    return f"the CP loss within {settings.verify_rtol:.0e} (train.verify_rtol) of the unrewritten copy's"


def _verify(record: dict, settings: TrainSettings, mesh) -> None:
    """Raise `VerificationError` on every rank when this step's CP loss is off its reference.
    The ranks hold the same numbers; they still agree by one all-reduce, so none waits alone."""
    failure = _step_failure(record, settings, mesh.cp_size)
    failed = torch.tensor([float(failure is not None)], device=settings.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=mesh.cp_group)
    if failed.item():
        raise VerificationError(failure or f"train.verify: step {record['step']}: another rank's reference "
                                           "disagreed with the CP loss beyond the tolerance")


def _step_failure(record: dict, settings: TrainSettings, cp_size: int) -> str | None:
    """None when the step passes, else one line saying by how much it missed (NaN misses)."""
    loss, reference = record["loss"], record["reference_loss"]
    where = f"train.verify: step {record['step']}:"
    if "fp32_reference_loss" in record:
        exact = record["fp32_reference_loss"]
        cp_error, single_error = _relative(loss, exact), _relative(reference, exact)
        if within_precision(cp_error, single_error):
            return None
        return (f"{where} the bfloat16 CP={cp_size} loss {loss:.6f} is {cp_error:.1e} off the float32 copy's "
                f"{exact:.6f}, more than {FACTOR:g} x the bfloat16 copy's {single_error:.1e} + {FLOOR:g}")
    error = _relative(loss, reference)
    if error <= settings.verify_rtol:
        return None
    return (f"{where} CP={cp_size} loss {loss:.6f} vs CP=1 loss {reference:.6f}, rel. diff {error:.1e} > "
            f"train.verify_rtol {settings.verify_rtol:.0e}")


def _relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def _format(record: dict, steps: int, cp_size: int) -> str:
    text = f"step {record['step']}/{steps}  loss {record['loss']:.6f}  ({record['seconds']:.2f} s, CP={cp_size})"
    if "reference_loss" in record:
        ref = record["reference_loss"]
        text += f"  CP=1 loss {ref:.6f}  rel. diff {_relative(record['loss'], ref):.1e}"
    if "fp32_reference_loss" in record:
        text += f"  fp32 CP=1 loss {record['fp32_reference_loss']:.6f}"
    return text
