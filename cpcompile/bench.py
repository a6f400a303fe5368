"""`cpcompile bench CONFIG.yaml`: time the training step a train config describes (docs/trainer.md),
with its CP plan against the same model without CP, in one run; launch it with `torchrun`.

Rows: the model rewritten by the plan on this rank's `seq_len / cp` tokens, and the unrewritten
model (as transformers runs it: its own GDN kernels where installed, its torch path otherwise) on
the same local tokens (what one device does with that share, without the collectives)
— plus, with `--full-sequence`, the unrewritten model on the whole `seq_len` (what CP spares each
device). Forward (to the loss) and backward are timed separately, median of `repeat` steps after
`warmup`, max over ranks; peak allocated/reserved memory of the measured steps on CUDA.
"""
from __future__ import annotations

import contextlib
import datetime
import time
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from .batch import shard_batch
from .errors import PlanError
from .pipeline import compile as cp_compile
from .mesh import build_mesh
from .trainer.config import TrainConfig
from .trainer.data import TokenStream
from .trainer.loop import check_world_size
from .trainer.parallelize import build_model


def time_steps(step: Callable[[], torch.Tensor], warmup: int, repeat: int, device: str,
               group: dist.ProcessGroup | None = None,
               context: Callable[[], ContextManager] = contextlib.nullcontext) -> dict:
    """Median forward and backward ms of `step` (returns a loss), and peak GiB on CUDA; each the max
    over the ranks of `group` (the default group when None; no reduction without a process group).
    Each step's forward and backward run inside one `context()` (e.g. PyTorch's `context_parallel`)."""
    cuda = device == "cuda"

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    forward, backward = [], []
    for i in range(warmup + repeat):
        if i == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        with context():
            t0 = now()
            loss = step()
            t1 = now()
            loss.backward()
            t2 = now()
        if i >= warmup:
            forward.append((t1 - t0) * 1e3)
            backward.append((t2 - t1) * 1e3)
    gib = 2.0 ** 30
    stats = torch.tensor([sorted(forward)[len(forward) // 2], sorted(backward)[len(backward) // 2],
                          torch.cuda.max_memory_allocated() / gib if cuda else float("nan"),
                          torch.cuda.max_memory_reserved() / gib if cuda else float("nan")], device=device)
    if dist.is_initialized():
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(("fwd", "bwd", "alloc", "reserved"), stats.tolist()))


def bench(config: TrainConfig, warmup: int, repeat: int, full_sequence: bool = False) -> list[dict]:
    """-> one row per variant: {"variant", "tokens", "fwd", "bwd", "alloc", "reserved"}."""
    settings = config.train
    if config.plan.accelerator.tp_size > 1:  # its rows compare CP with one device's share, without TP
        raise PlanError("accelerator.tp_size", f"is {config.plan.accelerator.tp_size}: cpcompile bench times CP "
                                               "alone (set tp_size: 1; `cpcompile train` runs TP with CP)")
    check_world_size(config.plan)
    mesh = build_mesh(config.plan.accelerator, device_type=settings.device,
                      timeout=datetime.timedelta(seconds=settings.collective_timeout_s))
    model = build_model(config.model, settings)
    batch = TokenStream(config.data, settings, model.config.get_text_config().vocab_size).batch(0)
    local = shard_batch(batch, mesh, config.plan)
    plain = build_model(config.model, settings)
    cp_compile(model, mesh, config.plan, example_inputs=local)
    runner = torch.compile(model, backend=settings.compile_backend) if settings.compile_backend else model
    methods = ", ".join(sorted({o.method.describe() for o in config.plan.active_overrides()})) or "no CP"
    variants = [(f"CP={mesh.cp_size}: {methods}", local, runner),
                ("no CP, the same local tokens", local, plain)]
    if full_sequence:
        variants.append(("no CP, the whole sequence", {**batch, "use_cache": False}, plain))
    rows = []
    for name, inputs, module in variants:
        def step(module=module, inputs=inputs):
            module.zero_grad(set_to_none=True)
            return module(**inputs).loss
        tokens = inputs["input_ids"].shape[1]
        rows.append({"variant": name, "tokens": tokens, **time_steps(step, warmup, repeat, settings.device)})
    return rows


def table(rows: list[dict], config: TrainConfig, warmup: int, repeat: int) -> str:
    s = config.train
    lines = [f"model {config.model.get('model_type') or config.model['path']}, batch {s.batch_size}, sequence {s.seq_len}, {s.dtype} on {s.device}; "
             f"median of {repeat} after {warmup} warm-up, max over ranks",
             "", "| variant | tokens per rank | warmup/repeat | fwd ms | bwd ms | peak alloc GiB | peak reserved GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['tokens']} | {warmup}/{repeat} | {r['fwd']:.2f} | {r['bwd']:.2f} "
                     f"| {r['alloc']:.2f} | {r['reserved']:.2f} |")
    return "\n".join(lines)
