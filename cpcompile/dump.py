"""Debug dump: per region, the graph around every pass, and one summary of what was done.

Layout of a dump directory:
    <region>/<NN>_<pass>.before.py, .after.py   readable graph code around each pass
    summary.json, summary.txt                   one row per rewritten region, and the model's
                                                features that need CP rules, with how each was
                                                handled (`model.hazards`, audit/config.py)

One directory per rank: in a job of more than one process, `compile(..., dump_dir=D)` (and
`cpcompile train` with `train.dump_dir: D`) writes `D/rank<r>`, r the global rank
(`resolve_dump_dir`); with one process, `D` itself.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from . import collectives as C
from .context import PassContext
from .errors import CPConfigError
from .passes.schedule import is_compute, is_model_compute

ENV_VAR = "CPCOMPILE_DUMP_DIR"


def resolve_dump_dir(dump_dir: str | os.PathLike | None, rank: int | None = None,
                     world_size: int | None = None) -> Path | None:
    """The folder this process writes its dump to: `dump_dir`, else `CPCOMPILE_DUMP_DIR`, else none.
    In a job of more than one process, `<dir>/rank<r>` with r the global rank, so that no two ranks
    write into one folder (every rank writes `summary.json`). `rank` and `world_size` default to
    torch.distributed's (0 of 1 without a process group). `compile` and `cpcompile train` follow
    this one rule; `cpcompile inspect <dir>` names the rank folders inside a job's folder."""
    chosen = dump_dir if dump_dir is not None else os.environ.get(ENV_VAR)
    if not chosen:
        return None
    if rank is None or world_size is None:
        initialized = dist.is_available() and dist.is_initialized()
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    return Path(chosen) / f"rank{rank}" if world_size > 1 else Path(chosen)


def collective_report(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """For each launch in `gm`: its wait, their positions, and the nodes between them.

    `between` lists every op between launch and wait; `compute_between` the ones that
    produce new data (no views, no collectives); `model_compute_between` those of them the
    model itself does rather than a CP pass — what an async method hides communication behind.
    """
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    rows = []
    for node in nodes:
        if node.op != "call_function" or not C.is_launch(node.target):
            continue
        waits = [u for u in node.users if C.is_wait(u.target)]
        wait = waits[0] if waits else None
        end = order[wait] if wait is not None else order[node]
        between = [n for n in nodes[order[node] + 1: end] if n.op == "call_function"]
        rows.append({
            "collective": C.collective_kind(node.target),
            "launch": node.name,
            "launch_pos": order[node],
            "wait": wait.name if wait is not None else None,
            "wait_pos": end if wait is not None else None,
            "between": [n.name for n in between],
            "compute_between": [n.name for n in between if is_compute(n)],
            "model_compute_between": [n.name for n in between if is_model_compute(n)],
        })
    return rows


def prepare_dump_dir(path: str | os.PathLike) -> Path:
    """Create `path` and check that files can be written in it; a `CPConfigError` naming it if not
    (a file in the way, no permission), raised before anything was traced or changed."""
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".cpcompile_write_check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise CPConfigError(
            f"dump_dir {os.fspath(path)!r}: cannot write the debug dump there ({exc.strerror or exc})"
        ) from exc
    return root


class Dump:
    def __init__(self, root: Path):
        self.root = prepare_dump_dir(root)
        self.regions: list[dict[str, Any]] = []
        self.hazards: list[dict[str, Any]] = []  # the model's features needing CP rules (audit/config.py)

    def set_hazards(self, hazards: list[dict[str, Any]]) -> None:
        self.hazards = hazards
        self.write_summary()

    def region_dir(self, fqn: str, variant: int) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", fqn) or "root"
        path = self.root / (safe if variant == 0 else f"{safe}.v{variant}")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def pass_observer(self, fqn: str, variant: int):
        directory = self.region_dir(fqn, variant)
        counter = iter(range(100))

        def on_pass(name: str, before: str, after: str) -> None:
            step = next(counter)
            (directory / f"{step:02d}_{name}.before.py").write_text(before)
            (directory / f"{step:02d}_{name}.after.py").write_text(after)

        return on_pass

    def add_region(self, ctx: PassContext, gm: fx.GraphModule, variant: int, backend: str = "-") -> None:
        purposes = {c.launch: c.purpose for c in ctx.collectives}
        self.regions.append({
            "fqn": ctx.fqn,
            "variant": variant,
            "method": ctx.method.name,
            "core": ctx.method.core,
            "wrapper": ctx.method.wrapper,
            "params": dict(ctx.method.params),
            "backend": backend,
            "cp_size": ctx.cp_size,
            "cp_rank": ctx.cp_rank,
            "group": ctx.group_name,
            "cores_rewritten": ctx.cores_rewritten,
            "collectives_inserted": [vars(c) for c in ctx.collectives],
            "schedule": [
                dict(row, purpose=purposes.get(row["launch"], "")) for row in collective_report(gm)
            ],
            "notes": list(ctx.notes),
        })
        self.write_summary()

    def write_summary(self) -> None:
        summary = {"model": {"hazards": self.hazards}, "regions": self.regions}
        (self.root / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        (self.root / "summary.txt").write_text(format_summary(self.regions, self.hazards))


def format_summary(regions: list[dict[str, Any]], hazards: list[dict[str, Any]] = ()) -> str:
    lines = [f"model: {h['feature']}={h['value']} ({h['where']}): {h['handling']}" for h in hazards]
    lines += [f"{'region':<40} {'method':<12} {'core':<5} {'backend':<8} collectives (launch@pos -> wait@pos, compute between)"]
    for r in regions:
        name = r["fqn"] + (f" (v{r['variant']})" if r.get("variant") else "")
        first = True
        for c in r["schedule"] or [None]:
            head = f"{name:<40} {r['method']:<12} {r['core']:<5} {r['backend']:<8}" if first else " " * 68
            if c is None:
                lines.append(f"{head} none")
            else:
                lines.append(
                    f"{head} {c['collective']}({c.get('purpose', '')}) {c['launch']}@{c['launch_pos']} -> "
                    f"{c['wait']}@{c['wait_pos']}, {len(c['between'])} between"
                    f" ({len(c.get('compute_between', []))} compute, {len(c.get('model_compute_between', []))} model)"
                )
            first = False
        for note in r.get("notes", []):
            lines.append(" " * 68 + f" note: {note}")
    return "\n".join(lines) + "\n"


def inspect(dump_dir: str | os.PathLike) -> str:
    path = Path(dump_dir) / "summary.json"
    if not path.exists():
        ranks = sorted(p.parent for p in Path(dump_dir).glob("*/summary.json"))
        if ranks:  # a job's folder holds one dump per rank
            raise FileNotFoundError(
                f"{dump_dir} holds one dump per rank; inspect one of them: {', '.join(map(str, ranks))}"
            )
        raise FileNotFoundError(f"{path} not found: is {dump_dir} a cpcompile dump directory?")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        return format_summary(summary["regions"], summary.get("model", {}).get("hazards", []))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, or not a summary's shape
        raise CPConfigError(f"{path} is damaged, not a summary cpcompile wrote ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]}); run with dump_dir= again to rewrite it") from exc
