"""Per-rank truth of a CP=N job on one device (`trainer_gpu.py --simulate-cp N`, issue 32 item 4).

One process plays one rank: PyTorch's fake process group (`dist.init_process_group("fake",
rank=r, world_size=N)`) stands in for the N-rank job, so every collective returns at once with a
buffer of the right shape (its contents are garbage: the loss is meaningless, the work is not):
the rank's memory and compute are real, its communication costs nothing. The trainer is the real
one (`build_trainer`: CP rewrite, activation checkpointing, FSDP2 over the N ranks, AdamW), at
N x (local tokens) global tokens, so each row is what rank r of the real job would allocate and
compute. Rank 0 and the last rank are the two ends: under causal SDPA AllGather the last rank's
queries see every key (the most attention work), rank 0's only its own; GDN State-P2P's rank 0 sends
no state gradient back and the last rank no state forward. Under Head-Tail (`--sdpa head_tail`:
SDPA Head-Tail, GDN State-P2P in Head-Tail order) every rank has the same attention work; its GDN
layers send two states a rank (a head's up, a tail's down), the ends one.

Each row runs in a fresh subprocess (a row that runs out of memory is a row saying OOM, and cannot
leave memory behind for the next one): `--warmup` steps, then `--steps` measured steps (their peak
allocated memory and mean time). One step runs under `CollectiveBytes` (collective_bytes.py: the
bytes this rank sends, by collective, formulas in its doc), never the first, whose one-off work -
FSDP2's lazy init, the CP regions tracing the bf16 signature and agreeing on it - is no step of the
run: the last warm-up step, or with `--warmup 1` the first measured step (`counted_step`). The
second saves a step on the longest rows, where one step takes minutes; its time then includes the
counting mode's Python work on each op, small beside a step that long (the results file gives a
row run both ways).

`--ranks` picks the rows' ranks: by default rank 0 and the last rank, or either alone, or rank N/2
(`middle`, alone or with both ends).

Predictions from a row (`predict`), per rank:
- comm time = bytes sent / `--bandwidth-gbps` (450 GB/s: an H200's NVLink, per direction);
- the step of the real job is at least max(compute, comm) (communication entirely hidden behind
  compute) and at most compute + comm (none hidden);
- comm/compute: the share of the compute time that communication takes; the overlap must hide that
  much for the step to cost its compute alone (above 100%: communication-bound whatever the overlap).
The job table takes, per (method, N, tokens), the slower of the two ranks.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

SDPA_WRAPPERS = {"all_gather": "sdpa_hf", "ulysses": "sdpa_hf_ulysses",
                 "head_tail": {"_target_": "cpcompile.wrappers.sdpa_hf_load_balance_cp_wrapper"}}
# the GDN method beside each: State-P2P, in Head-Tail order beside Head-Tail (one batch order)
GDN_METHODS = {"all_gather": "p2p", "ulysses": "p2p", "head_tail": "p2p_head_tail"}
ROW_MARK = "SIMULATED_ROW "
GB = 1e9
# a row needs at least this much of the budget left to start (imports, model build, CP rewrite)
MIN_ROW_SECONDS = 60


def parse_tokens(text: str) -> list[int]:
    """'128K,256K,1M,4096' -> [131072, 262144, 1048576, 4096] (K = 1024, M = 1024^2)."""
    scale = {"": 1, "K": 1024, "M": 1024 ** 2}
    values = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KkMm]?)\s*", item)
        if not match:
            raise ValueError(f"--tokens: {item!r} is not a count like 4096, 128K or 1M")
        values.append(int(match.group(1)) * scale[match.group(2).upper()])
    return values


def short_tokens(count: int) -> str:
    for unit, size in (("M", 1024 ** 2), ("K", 1024)):
        if count % size == 0:
            return f"{count // size}{unit}"
    return str(count)


RANK_CHOICES = {"ends": ("first", "last"), "first": ("first",), "last": ("last",), "middle": ("middle",),
                "ends+middle": ("first", "middle", "last")}
RANK_OF_END = {"first": lambda cp: 0, "middle": lambda cp: cp // 2, "last": lambda cp: cp - 1}


def counted_step(warmup: int) -> int:
    """The index of the step whose collectives are counted: the last warm-up step, or the first
    measured one when there is one warm-up step only (module doc)."""
    if warmup < 1:
        raise ValueError("--warmup must be >= 1: the first step's one-off work is no step of the run")
    return warmup - 1 if warmup >= 2 else warmup


def row_specs(cp_sizes: list[int], tokens: list[int], methods: list[str], ranks: str = "ends") -> list[dict]:
    """Every (method, N, global tokens, rank) row, the cheapest first: fewer tokens, then more ranks
    (fewer local tokens), so a budget that runs out cuts the most expensive rows. `ranks`: a key of
    RANK_CHOICES."""
    specs = []
    for count in sorted(tokens):
        for cp in sorted(cp_sizes, reverse=True):
            for method in methods:
                for rank in sorted({RANK_OF_END[end](cp) for end in RANK_CHOICES[ranks]}):
                    specs.append({"method": method, "cp": cp, "tokens": count, "rank": rank})
    return specs


# ----------------------------------------------------------------------------------- parent


def run_all(args, argv: list[str], script: str) -> list[dict]:
    """Run every row in its own subprocess (`script argv --simulate-row SPEC`), within
    `args.max_seconds`; -> the rows, each the child's dict or one with a `note`."""
    start, rows = time.perf_counter(), []
    refused: dict = {}  # (method, cp) -> why: the heads do not allow that N, whatever the tokens
    out_of_memory: set = set()  # (method, cp, rank): more tokens will not fit either
    for spec in row_specs(args.simulate_cp, args.tokens, args.sdpa, args.ranks):
        key = (spec["method"], spec["cp"])
        left = args.max_seconds - (time.perf_counter() - start)
        if key in refused:
            rows.append({**spec, "note": refused[key]})
        elif (*key, spec["rank"]) in out_of_memory:
            rows.append({**spec, "note": "OOM (at fewer tokens already)"})
        elif left < MIN_ROW_SECONDS:
            rows.append({**spec, "note": "not run: over the --max-seconds budget"})
        else:
            row = run_child(spec, [sys.executable, script, *argv, "--simulate-row", json.dumps(spec)], left)
            rows.append(row)
            note = row.get("note", "")
            if note.startswith("refused"):
                refused[key] = note
            if note.startswith("OOM"):
                out_of_memory.add((*key, spec["rank"]))
        print(f"[{time.perf_counter() - start:.0f} s] " + describe(rows[-1]), flush=True)
        if "profile" in rows[-1]:
            print(rows[-1].pop("profile"), flush=True)
    return rows


def run_child(spec: dict, command: list[str], seconds: float) -> dict:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return {**spec, "note": "stopped: over the --max-seconds budget"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(ROW_MARK):
            return json.loads(line[len(ROW_MARK):])
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {**spec, "note": f"failed (exit {done.returncode}): {last[:200]}"}


def describe(row: dict) -> str:
    where = f"{row['method']} N={row['cp']} {short_tokens(row['tokens'])} rank {row['rank']}"
    if "note" in row:
        return f"{where}: {row['note']}"
    return f"{where}: {row['compute_s']:.3f} s, {_mb(row['sent']['total'])} MB sent"


# ------------------------------------------------------------------------------------ child


def run_row(args, spec: dict, train_config_for) -> dict:
    """One rank of a CP=N job under the fake process group: build, warm up, measure, counting the
    bytes sent in `counted_step`; -> the row. `train_config_for(args, sdpa_wrapper, gdn_method)` is
    the script's config."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cpcompile.errors import CPCompileError
    from cpcompile.trainer.dry_run_report import memory_estimate
    from cpcompile.trainer.loop import build_trainer
    from cpcompile.trainer.metrics import peak_memory_gib
    from cpcompile.trainer.parallelize import parameter_count
    from collective_bytes import CollectiveBytes
    from step_profile import kernel_table

    dist.init_process_group("fake", store=FakeStore(), rank=spec["rank"], world_size=spec["cp"])
    args.cp, args.seq_len = spec["cp"], spec["tokens"]
    config = train_config_for(args, SDPA_WRAPPERS[spec["method"]], GDN_METHODS[spec["method"]])
    row = {**spec, "local_tokens": spec["tokens"] // spec["cp"]}
    phase = "build"
    try:
        trainer = build_trainer(config)
        row["estimate_gib"] = memory_estimate(config, parameter_count(trainer.model), trainer.model.config,
                                              rank=spec["rank"])["total"]
        # A dispatch mode cannot watch compiled code, and one active at the first compiled call makes
        # Dynamo leave the layers eager for good: with compiled layers the bytes are counted in one
        # step more, run eagerly (the same collectives), after the measured ones.
        compiled = config.train.layer_compile_backend() is not None
        phase, sent, seconds = "warm-up", CollectiveBytes(), []
        counted = None if compiled else counted_step(args.warmup)
        for index in range(args.warmup + args.steps):
            if index == args.warmup:
                phase = "measured steps"
                if args.device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
            with sent if index == counted else contextlib.nullcontext():
                record = trainer.step(index)
            if index >= args.warmup:
                seconds.append(record["seconds"])
        peak = peak_memory_gib(args.device)
        if compiled:
            phase = "counted step"
            with torch.compiler.set_stance("force_eager"), sent:
                trainer.step(args.warmup + args.steps)
        if args.profile:  # one step more, not measured: the profiler slows it
            phase, tables = "profiled step", []
            with kernel_table(args.device, tables):
                trainer.step(args.warmup + args.steps)
            row["profile"] = tables[0]
    except torch.OutOfMemoryError as exc:
        return {**row, "note": f"OOM ({phase}: {str(exc).splitlines()[0][:120]})"}
    except CPCompileError as exc:
        if phase != "build":
            raise
        return {**row, "note": f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    compute = sum(seconds) / len(seconds)
    return {**row, "compute_s": compute, "tokens_per_s": row["local_tokens"] / compute,
            "peak_gib": peak,
            "sent": {**sent.by_category(), "total": sent.total},
            "collectives": sent.by_collective(), "unknown": dict(sent.unknown)}


# -------------------------------------------------------------------------------- the tables


def predict(row: dict, bandwidth_gbps: float) -> dict:
    """comm time, the step's bounds and comm/compute for one measured row (module doc)."""
    comm = row["sent"]["total"] / (bandwidth_gbps * GB)
    compute = row["compute_s"]
    return {"comm_s": comm, "overlapped_s": max(compute, comm), "serial_s": compute + comm,
            "comm_share": comm / compute}


def rank_table(rows: list[dict], bandwidth_gbps: float) -> str:
    head = ("| SDPA | N | global tokens | local tokens | rank | peak GiB | estimate GiB | est/peak | compute s | "
            "tokens/s/rank | MB sent (CP + FSDP2 + reductions) | comm s | step s (overlapped - serial) | "
            "comm/compute |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in sorted(rows, key=lambda r: (r["method"], r["cp"], r["tokens"], r["rank"])):
        first = (f"| {row['method']} | {row['cp']} | {short_tokens(row['tokens'])} | "
                 f"{short_tokens(row['tokens'] // row['cp'])} | {row['rank']} |")
        if "note" in row:
            lines.append(f"{first} {row['note']} |" + " |" * 8)
            continue
        p, sent, peak, estimate = predict(row, bandwidth_gbps), row["sent"], row["peak_gib"], row["estimate_gib"]
        lines.append(
            f"{first} {_num(peak)} | {estimate:.3g} | {_num(estimate / peak if peak else None)} | "
            f"{row['compute_s']:.3f} | {row['tokens_per_s']:.0f} | {_mb(sent['total'])} "
            f"({_mb(sent['cp'])} + {_mb(sent['fsdp'])} + {_mb(sent['reductions'])}) | "
            f"{p['comm_s']:.3g} | {p['overlapped_s']:.3f} - {p['serial_s']:.3f} | {100 * p['comm_share']:.1f}% |")
    return "\n".join(lines)


def job_table(rows: list[dict], bandwidth_gbps: float) -> str:
    """Per (method, N, tokens) with every chosen rank measured: the slowest rank's step bounds, the
    job's tokens/s at them, and the spread of the ranks' compute (slowest / fastest)."""
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["method"], row["cp"], row["tokens"]), []).append(row)
    lines = ["| SDPA | N | global tokens | slowest rank | step s (overlapped - serial) | job tokens/s | "
             "compute slowest / fastest |", "|---|---|---|---|---|---|---|"]
    for (method, cp, tokens), members in sorted(groups.items()):
        measured = [r for r in members if "note" not in r]
        if len(measured) < len(members) or not measured:
            continue
        bounds = [(predict(r, bandwidth_gbps), r["rank"]) for r in measured]
        low = max(p["overlapped_s"] for p, _ in bounds)
        high, slowest = max((p["serial_s"], rank) for p, rank in bounds)
        computes = [r["compute_s"] for r in measured]
        lines.append(f"| {method} | {cp} | {short_tokens(tokens)} | {slowest} | {low:.3f} - {high:.3f} | "
                     f"{tokens / high:.0f} - {tokens / low:.0f} | {max(computes) / min(computes):.2f} |")
    return "\n".join(lines)


def _mb(count: int) -> str:
    return f"{count / 1e6:.4g}"


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def child_main(args, spec_json: str, train_config_for) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    row = run_row(args, json.loads(spec_json), train_config_for)
    print(ROW_MARK + json.dumps(row), flush=True)
