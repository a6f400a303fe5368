"""What the trainer reports: one line per step (rank 0), one JSON line per step, a summary, and
a stop at the first non-finite loss or gradient norm. Also the plot of two runs' curves
(`cpcompile compare`), with matplotlib when it is installed."""
from __future__ import annotations

import json
import math
import os
from typing import Callable

import torch

from ..errors import NonFiniteError

GIB = 2.0 ** 30


def peak_memory_gib(device: str) -> float | None:
    """Peak allocated memory of this process on CUDA since the last reset, else None."""
    if device != "cuda":
        return None
    return torch.cuda.max_memory_allocated() / GIB


def check_finite(record: dict) -> None:
    for key in ("loss", "grad_norm"):
        value = record.get(key)
        if value is not None and not math.isfinite(value):
            raise NonFiniteError(f"step {record['step']}: the {key.replace('_', ' ')} is {value}: training stopped "
                                 "(lower train.lr, set train.grad_clip, or check the data)")


def format_step(record: dict, steps: int) -> str:
    text = (f"step {record['step']}/{steps}  loss {record['loss']:.6f}  grad-norm {record['grad_norm']:.4f}  "
            f"lr {record['lr']:.3e}  {record['tokens_per_s']:.0f} tok/s  {record['seconds']:.2f} s")
    if record.get("peak_memory_gib") is not None:
        text += f"  peak {record['peak_memory_gib']:.2f} GiB"
    if "reference_loss" in record:
        ref = record["reference_loss"]
        text += f"  CP=1 loss {ref:.6f}  rel. diff {relative(record['loss'], ref):.1e}"
    if "fp32_reference_loss" in record:
        text += f"  fp32 CP=1 loss {record['fp32_reference_loss']:.6f}"
    return text


def relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


class MetricsLog:
    """Rank 0's step lines (through `log`) and JSONL file; other ranks keep records only.

    A run that starts at step 1 writes the file anew; one resumed after step `resumed_at` keeps
    the lines up to that step and drops the later ones (`keep_steps_up_to`): the run that saved
    the checkpoint may have gone on past it before it stopped, and the resumed run redoes those
    steps, so the file holds each step once, as the resumed run computed it."""

    def __init__(self, path: str | None, steps: int, log: Callable[[str], None], enabled: bool, resumed_at: int = 0):
        self.steps, self.log, self.enabled = steps, log, enabled
        self.handle = None
        if enabled and path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if resumed_at > 0:
                keep_steps_up_to(path, resumed_at)
            self.handle = open(path, "a" if resumed_at > 0 else "w", encoding="utf-8")

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        self.log(format_step(record, self.steps))
        if self.handle:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()

    def close(self) -> None:
        if self.handle:
            self.handle.close()


def keep_steps_up_to(path: str, step: int) -> None:
    """Rewrite the JSONL file at `path` without the lines of steps after `step` (a missing file
    is left missing); through a temporary file renamed over it, so a crash keeps the old file."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    kept = [line for line in lines if _step_of(line) is None or _step_of(line) <= step]
    if len(kept) == len(lines):
        return
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as handle:
        handle.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
    os.replace(partial, path)


def _step_of(line: str) -> int | None:
    """The step a JSONL line records; None for a line that is not a step's record (kept as it is)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def warmup_steps(compiled: bool) -> int:
    """Steps the summary leaves out of the throughput: the first (tracing, warm-up), and with
    compiled layers the second too (`cpcompile.compiled` runs a new input signature eagerly once,
    so that the CP regions trace; Dynamo compiles at the second call)."""
    return 2 if compiled else 1


def timed_steps(records: list[dict], warmup: int = 1) -> list[dict]:
    """The steps after `warmup`; all of them when there are no more."""
    return records[warmup:] or records


def summary(records: list[dict], tokens_per_step: int, flops_per_token: float | None = None,
            peak_flops: float | None = None, warmup: int = 1) -> str:
    """The final line: steps, first and last loss, mean throughput after the `warmup` steps
    (`warmup_steps`), peak memory, and MFU when the peak FLOP/s is known."""
    if not records:
        return "summary: no step ran"
    timed = timed_steps(records, warmup)
    seconds = sum(r["seconds"] for r in timed) / len(timed)
    text = (f"summary: {len(records)} steps  loss {records[0]['loss']:.6f} -> {records[-1]['loss']:.6f}  "
            f"{tokens_per_step / seconds:.0f} tok/s  {seconds:.3f} s/step (mean of steps {timed[0]['step']}.."
            f"{timed[-1]['step']})")
    peaks = [r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None]
    if peaks:
        text += f"  peak {max(peaks):.2f} GiB"
    if flops_per_token and peak_flops:
        text += f"  MFU {100 * flops_per_token * tokens_per_step / seconds / peak_flops:.1f}%"
    return text


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_curves(runs: dict[str, list[dict]], path: str, title: str) -> str | None:
    """Loss and grad-norm of each run against the step, in one PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (name, records), style in zip(runs.items(), ("-", "--", ":", "-.")):
        steps = [r["step"] for r in records]
        axes[0].plot(steps, [r["loss"] for r in records], style, label=name)
        axes[1].plot(steps, [r["grad_norm"] for r in records], style, label=name)
    for axis, label in zip(axes, ("loss", "grad-norm")):
        axis.set_xlabel("step")
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
