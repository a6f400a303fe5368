"""Where the async CP methods' launches and waits fall among the compute kernels, on one GPU.

    python benchmarks/overlap_timeline.py [--methods all_gather ulysses hybrid] [--world 4] \
        [--seq 16384] [--layers 1] [--steps 1] [--dump-dir overlap_timeline_dump] [--out FILE]

One process plays rank 0 of a `--world`-rank cp group under the fake process group, on the
current CUDA device, with the model under `torch.compile` (Inductor, so cpcompile's backward
schedule applies). The fake group's collectives move no data and launch no kernel, so nothing
here measures overlap — a single-rank NCCL group cannot either; that table needs 2+ GPUs
(`overlap_report.py --device cuda --compile` under torchrun). What it shows is the order on
the real CUDA timeline: where each launch and each wait falls among the compute kernels
Inductor's code issues, forward and backward.

From the profiler's Chrome trace (exported per method into `--dump-dir`), per phase
(`record_function` markers; the backward runs on autograd's device thread, so events are taken
by time from every thread): the collective ops (`_c10d_functional::*`) in issue order, and
between two of them the compute kernels issued, matched to their GPU execution through the
launch's correlation id. `L <kind>` is a launch, `W` a wait, `[n kernels, x ms]` the GPU time
of the kernels issued in between. The summary counts the compute GPU time issued while at least
one collective was in flight (launched, not yet waited): the work that real communication could
hide behind. A synchronous backward shows `L W` pairs with nothing between.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overlap_report import ROOT, VOCAB, make_model, plan_for  # noqa: E402

import cpcompile  # noqa: E402

PHASES = {"forward": "cp_forward", "backward": "cp_backward"}
# kernel launches on the CPU side: runtime API (cuBLAS, cuDNN, ATen) and driver API (Triton)
LAUNCH_RUNTIME_CALLS = ("LaunchKernel", "cuLaunch", "cudaLaunch")


def profile_method(method: str, args) -> Path:
    """Compile one async method on the fake group, warm up, profile; return the trace's path."""
    from torch.profiler import ProfilerActivity, profile, record_function

    plan = cpcompile.load_plan(plan_for(method, True, args))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cuda")
    ids = torch.randint(0, VOCAB, (1, args.seq), generator=torch.Generator().manual_seed(1)).cuda()
    local = cpcompile.shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh, plan)
    model = cpcompile.compile(make_model(args).to("cuda", torch.bfloat16), mesh, plan, example_inputs=local)
    torch._dynamo.reset()
    compiled = torch.compile(model)

    def step():
        with record_function(PHASES["forward"]):
            loss = compiled(**local).loss
            torch.cuda.synchronize()
        with record_function(PHASES["backward"]):
            loss.backward()
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)

    for _ in range(2):  # compile forward and backward, then one plain step
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
    path = Path(args.dump_dir) / f"trace_{method}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def phase_sequences(trace: dict, phase: str, classify_event=None) -> list[list[tuple]]:
    """Per profiled step: the phase's items in issue order, ("L", kind) / ("W",) / ("K", name, gpu_us)
    (``classify_event(event, gpu_us)``, default ``classify``, maps one trace event to an item or None)."""
    classify_event = classify_event or classify
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu_us = {e["args"]["correlation"]: (e["name"], e["dur"]) for e in events
              if e.get("cat") == "kernel" and "correlation" in e.get("args", {})}
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "user_annotation" and e["name"] == PHASES[phase])
    steps = []
    for start, end in windows:
        items = []
        for e in sorted((e for e in events if start <= e["ts"] <= end), key=lambda e: e["ts"]):
            item = classify_event(e, gpu_us)
            if item is not None:
                items.append(item)
        steps.append(items)
    return steps


def classify(event: dict, gpu_us: dict) -> tuple | None:
    name, category = event["name"], event.get("cat", "")
    if category == "cpu_op" and name.startswith("_c10d_functional::"):
        op = name.split("::", 1)[1]
        return ("W",) if op.startswith("wait_tensor") else ("L", op)
    if category in ("cuda_runtime", "cuda_driver") and any(call in name for call in LAUNCH_RUNTIME_CALLS):
        kernel = gpu_us.get(event.get("args", {}).get("correlation"))
        if kernel is not None:
            return ("K", *kernel)
    return None


def kernel_run(kernels: int, kernel_us: float) -> str:
    """A run of compute kernels between two communication events, as the sequences print it."""
    return f"[{kernels} kernels, {kernel_us / 1e3:.2f} ms]"


def summarize(items: list[tuple]) -> dict:
    """The sequence as text; counts; the compute GPU time issued with a collective in flight."""
    parts: list[str] = []
    kernels, kernel_us = 0, 0.0           # the run of kernels since the last collective op
    previous = None                       # "L" or "W": the last collective op
    out = {"launches": 0, "waits": 0, "waits_without_compute": 0, "compute_ms": 0.0, "in_flight_ms": 0.0}
    in_flight = 0
    for item in items:
        if item[0] == "K":
            kernels, kernel_us = kernels + 1, kernel_us + item[2]
            out["compute_ms"] += item[2] / 1e3
            out["in_flight_ms"] += item[2] / 1e3 if in_flight else 0.0
            continue
        if kernels:
            parts.append(kernel_run(kernels, kernel_us))
        if item[0] == "L":
            parts.append(f"L {item[1]}")
            out["launches"] += 1
            in_flight += 1
        else:
            parts.append("W")
            out["waits"] += 1
            out["waits_without_compute"] += previous == "L" and not kernels
            in_flight = max(in_flight - 1, 0)
        previous, kernels, kernel_us = item[0], 0, 0.0
    if kernels:
        parts.append(kernel_run(kernels, kernel_us))
    return {"sequence": " ".join(parts), **out}


def percent(part: float, whole: float) -> float:
    return 100 * part / whole if whole else 0.0


def sequence_lines(rows: list[dict], label) -> list[str]:
    """Each row's event sequence under a bold ``label(row)``: the reports' last section."""
    lines = [""]
    for r in rows:
        lines += [f"**{label(r)}:** {r['sequence']}", ""]
    return lines


def report(rows: list[dict], args) -> str:
    shape = (f"B=1 S={args.seq} (S/cp={args.seq // args.world}) hidden={args.hidden} heads={args.heads}/{args.kv_heads} "
             f"layers={args.layers}, bf16")
    lines = [
        f"# Async CP order on one GPU, {_dt.date.today().isoformat()}",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; rank 0 of a fake {args.world}-rank cp group "
        f"(collectives move nothing: order only, no overlap figure); `torch.compile` (Inductor). {shape}. "
        "Produced by `benchmarks/overlap_timeline.py`; the last profiled step is shown.",
        "",
        "`L` launch, `W` wait, `[n kernels, x ms]` GPU time of the compute kernels issued in between; "
        "'in flight': compute GPU time issued while a collective was launched and not yet waited.",
        "",
        "| method | phase | launches | waits | waits with no kernel since the last launch | compute ms | in flight ms | in flight % |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['phase']} | {r['launches']} | {r['waits']} | {r['waits_without_compute']} | "
                     f"{r['compute_ms']:.2f} | {r['in_flight_ms']:.2f} | {percent(r['in_flight_ms'], r['compute_ms']):.0f} |")
    lines += sequence_lines(rows, lambda r: f"{r['method']}, {r['phase']}")
    return "\n".join(lines)


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=["all_gather", "ulysses", "hybrid"],
                        choices=["all_gather", "ulysses", "hybrid"])
    parser.add_argument("--world", type=int, default=4, help="the fake cp group's size (Hybrid: a multiple of 2)")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--ulysses-degree", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--dump-dir", default="overlap_timeline_dump")
    parser.add_argument("--out", default=None, help="markdown report (default: benchmarks/results/overlap_timeline_<date>_<gpu>.md)")
    args = parser.parse_args()

    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"overlap_timeline_{_dt.date.today().isoformat()}_{gpu}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in args.methods:  # the report is rewritten after each method: a cut run keeps what it measured
        trace = json.loads(profile_method(method, args).read_text())
        for phase in PHASES:
            last_step = phase_sequences(trace, phase)[-1]
            rows.append({"method": method, "phase": phase, **summarize(last_step)})
        out.write_text(report(rows, args))
        print(f"{method}: done", flush=True)
    dist.destroy_process_group()
    print(out.read_text())


if __name__ == "__main__":
    main()
