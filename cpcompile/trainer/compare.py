"""`cpcompile compare A.yaml B.yaml --steps N`: run two train configs for N steps, each with the
processes its mesh needs (`cpcompile train --nproc-per-node P`), and judge them step by step.

Writes to the output folder: `a.jsonl`, `b.jsonl` (each run's metrics), `compare.md` (a table of
every step's loss and grad-norm, their relative differences, and the verdict) and `compare.png`
(both curves; needs matplotlib, in the `[train]` extra). Passes when every step's loss and
grad-norm differ by at most `rtol` (relative).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from ..errors import CPCompileError
from ..yaml_input import check_size
from .config import load_train_config
from .field_checks import check_number
from .metrics import plot_curves, read_jsonl, relative

Launch = Callable[[str, int, int, str], None]  # (config path, processes, steps, metrics file)


@dataclass
class Comparison:
    rows: list[dict]
    worst: float
    rtol: float
    table: str
    plot: str | None

    @property
    def passed(self) -> bool:
        return self.worst <= self.rtol


def cpcompile_launch(config: str, processes: int, steps: int, metrics: str) -> None:
    """`python -m cpcompile train --nproc-per-node P CONFIG --steps N --metrics FILE` (its own workers,
    cpcompile/launch.py: a failing run says its one line, without torchrun's report)."""
    command = [sys.executable, "-m", "cpcompile", "train", "--nproc-per-node", str(processes), config,
               "--steps", str(steps), "--metrics", metrics]
    result = subprocess.run(command)
    if result.returncode:
        raise CPCompileError(f"compare: the run of {config} failed (exit status {result.returncode}): "
                             f"{' '.join(command)}")


def compare_configs(config_a: str, config_b: str, steps: int, rtol: float, out: str,
                    launch: Launch = cpcompile_launch, log: Callable[[str], None] = print) -> Comparison:
    """Run both configs for `steps` and judge them. The arguments and both configs are checked
    before either run starts (a PlanError naming `--steps`, `--rtol` or the config's field)."""
    check_size("--steps", steps)
    check_number("--rtol", rtol, low=0.0)
    configs = {"a": (config_a, load_train_config(config_a)), "b": (config_b, load_train_config(config_b))}
    os.makedirs(out, exist_ok=True)
    runs = {}
    for name, (path, config) in configs.items():
        metrics = os.path.join(out, f"{name}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        launch(path, config.plan.accelerator.world_size, steps, metrics)
        runs[name] = read_jsonl(metrics)
    comparison = judge(runs["a"], runs["b"], rtol)
    labels = {f"A: {os.path.basename(config_a)}": runs["a"], f"B: {os.path.basename(config_b)}": runs["b"]}
    comparison.plot = plot_curves(labels, os.path.join(out, "compare.png"), f"{steps} steps, rtol {rtol:g}")
    with open(os.path.join(out, "compare.md"), "w", encoding="utf-8") as handle:
        handle.write(comparison.table + "\n")
    log(comparison.table)
    if comparison.plot is None:
        log("plot: skipped (matplotlib is not installed: pip install \"cpcompile[train]\")")
    return comparison


def judge(a: list[dict], b: list[dict], rtol: float) -> Comparison:
    """Step-by-step relative differences of loss and grad-norm; a missing step or a NaN fails."""
    rows, worst = [], 0.0
    for ra, rb in zip(a, b):
        row = {"step": ra["step"], "loss_a": ra["loss"], "loss_b": rb["loss"], "grad_norm_a": ra["grad_norm"],
               "grad_norm_b": rb["grad_norm"], "loss_rel": relative(ra["loss"], rb["loss"]),
               "grad_norm_rel": relative(ra["grad_norm"], rb["grad_norm"])}
        rows.append(row)
        differences = (row["loss_rel"], row["grad_norm_rel"], 0.0 if ra["step"] == rb["step"] else math.inf)
        worst = max(worst, *(d if not math.isnan(d) else math.inf for d in differences))
    if len(a) != len(b) or not rows:
        worst = float("inf")
    verdict = "PASS" if worst <= rtol else "FAIL"
    lines = ["| step | loss A | loss B | rel. diff | grad-norm A | grad-norm B | rel. diff |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['loss_a']:.10f} | {r['loss_b']:.10f} | {r['loss_rel']:.1e} | "
              f"{r['grad_norm_a']:.8f} | {r['grad_norm_b']:.8f} | {r['grad_norm_rel']:.1e} |" for r in rows]
    lines.append(f"\n{verdict}: worst relative difference {worst:.1e} over {len(rows)} steps "
                 f"({len(a)} vs {len(b)} recorded), tolerance {rtol:g}")
    return Comparison(rows, worst, rtol, "\n".join(lines), None)
