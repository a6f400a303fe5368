"""`cpcompile train CONFIG.yaml`: train a Hugging Face causal LM, built from a config with random
weights, with the context parallelism the config's plan declares; launch it with `torchrun`.

The YAML holds the plan (`accelerator:`, `plan_overrides:`, as for `load_plan`) and two more
sections::

    model:                      # a transformers config: AutoConfig.for_model(model_type, **rest)
      model_type: qwen3_5_text
      hidden_size: 64
      ...
    train:
      steps: 10                 # optimizer steps
      seq_len: 256              # tokens per sequence (global, before CP sharding)
      batch_size: 2
      lr: 1.0e-3                # AdamW
      seed: 0                   # weights and the synthetic token stream (same on every rank)
      dtype: float32            # float32 | bfloat16 | float64
      device: cpu               # cpu | cuda | npu
      compile_backend: null     # or a torch.compile backend (aot_eager, inductor)
      dump_dir: null            # the rewritten graphs, one folder per rank
      verify: false             # also train an unrewritten copy on the whole batch; print both losses

Data are random token ids (no dataset is downloaded). Every step: `shard_batch` of the global
batch, forward/backward of this rank's slice, gradients summed over the CP group, AdamW step; rank 0
prints the global mean loss. Only CP is run here: data/tensor/pipeline-parallel sizes must be 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Callable

import torch

from .batch import shard_batch
from .errors import PlanError, short_repr
from .pipeline import compile as cp_compile
from .loss import all_reduce_gradients
from .mesh import build_mesh
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

    def validate(self) -> "TrainSettings":
        for name in ("steps", "seq_len", "batch_size"):
            check_size(f"train.{name}", getattr(self, name))
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or self.lr <= 0:
            hint = " (YAML reads 1e-3 as a string: write 1.0e-3)" if isinstance(self.lr, str) else ""
            raise PlanError("train.lr", f"must be a positive number, got {short_repr(self.lr)}{hint}")
        if self.dtype not in DTYPES:
            raise PlanError("train.dtype", f"must be one of {sorted(DTYPES)}, got {short_repr(self.dtype)}")
        if self.device not in ("cpu", "cuda", "npu"):
            raise PlanError("train.device", f"must be cpu, cuda or npu, got {short_repr(self.device)}")
        return self


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
    return TrainConfig(dict(model), TrainSettings(**settings).validate(), plan)


def build_model(model_config: dict, settings: TrainSettings) -> torch.nn.Module:
    """The same randomly initialised causal LM on every rank (seeded), SDPA attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(model_config)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(settings.seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.to(device=settings.device, dtype=DTYPES[settings.dtype])


def synthetic_batch(step: int, settings: TrainSettings, vocab_size: int) -> dict:
    """Random token ids, identical on every rank for a given step (the CP batch contract)."""
    gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    ids = torch.randint(0, vocab_size, (settings.batch_size, settings.seq_len), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return {k: v.to(settings.device) for k, v in batch.items()}


def train(config: TrainConfig, log: Callable[[str], None] = print) -> list[dict]:
    """Run the loop; -> one record per step: {"step", "loss", "reference_loss" (verify), "seconds"}.
    Call inside an initialised process group of `cp_size` ranks (torchrun), or let `build_mesh` make one."""
    settings = config.train
    mesh = build_mesh(config.plan.accelerator, device_type=settings.device)
    model = build_model(config.model, settings)
    reference = build_model(config.model, settings) if settings.verify else None
    vocab = model.config.get_text_config().vocab_size
    first = shard_batch(synthetic_batch(0, settings, vocab), mesh, config.plan)
    dump = None if settings.dump_dir is None else f"{settings.dump_dir}/rank{mesh.cp_rank}"
    cp_compile(model, mesh, config.plan, dump_dir=dump, example_inputs=first)
    runner = torch.compile(model, backend=settings.compile_backend) if settings.compile_backend else model
    optimizers = [torch.optim.AdamW(m.parameters(), lr=settings.lr) for m in (model, reference) if m is not None]
    records = []
    for step in range(settings.steps):
        start = time.perf_counter()
        batch = synthetic_batch(step, settings, vocab)
        out = runner(**shard_batch(batch, mesh, config.plan))
        out.loss.backward()
        all_reduce_gradients(model, mesh)
        loss = out.loss.detach().float()
        torch.distributed.all_reduce(loss, group=mesh.cp_group)  # rank shares sum to the global mean
        record = {"step": step + 1, "loss": loss.item(), "seconds": time.perf_counter() - start}
        if reference is not None:
            ref_loss = reference(**batch, use_cache=False).loss
            ref_loss.backward()
            record["reference_loss"] = ref_loss.item()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        records.append(record)
        if mesh.cp_rank == 0:
            log(_format(record, settings.steps, mesh.cp_size))
    return records


def _format(record: dict, steps: int, cp_size: int) -> str:
    text = f"step {record['step']}/{steps}  loss {record['loss']:.6f}  ({record['seconds']:.2f} s, CP={cp_size})"
    if "reference_loss" in record:
        ref = record["reference_loss"]
        text += f"  CP=1 loss {ref:.6f}  rel. diff {abs(record['loss'] - ref) / abs(ref):.1e}"
    return text
