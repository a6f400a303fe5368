"""How much communication the async CP methods hide under compute (CPU/gloo, or CUDA/NCCL).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/overlap_report.py \
        [--methods all_gather ulysses] [--seq 2048] [--steps 3] [--dump-dir overlap_dump] [--out FILE]
    (Hybrid needs 4 ranks: --nproc-per-node 4 --methods hybrid --ulysses-degree 2 --append)
    torchrun --standalone --nproc-per-node P benchmarks/overlap_report.py --device cuda --compile [...]   # bf16, NCCL
    (`--compile`: the model under torch.compile with Inductor, where the backward collectives are
    scheduled too, docs/async.md; eager backward is synchronous. On one GPU use overlap_timeline.py.
    On CPU, Inductor's C++ kernels are no aten::* events, so the CPU figure under --compile misses
    compute: measure compiled overlap on CUDA.)

For each method, its sync wrapper and its async wrapper are compiled on one Qwen3-shaped model
(fp32, batch 1) and profiled with torch.profiler over `--steps` forward+backward steps after one
warm-up step. Each run exports a Chrome trace per rank into the dump directory, next to
cpcompile's own graph dump of that run.

How overlap is measured. gloo runs every collective on its own worker thread and the profiler
records it there as one `gloo:<collective>` event spanning the collective's execution (from
the moment the worker starts it, peer waiting included, to its completion). The main thread
records the ATen ops the model runs. Per rank and per phase (forward / backward, split by
`record_function` markers on the main thread):

    comm total = length of the union of the gloo:* windows
    hidden     = length of (union of gloo:* windows) ∩ (union of main-thread aten::* windows)
    overlap    = hidden / comm total

Waiting (`_c10d_functional::wait_tensor`) and issuing collectives are not aten::* ops, so a
rank blocked in a wait hides nothing. Figures are averaged over ranks. Timing depends on the
machine (here: CPU cores shared by all ranks and their gloo threads); the ratio is the point.

With `--device cuda` the same is measured on the GPU timeline: NCCL kernels are the
communication, every other kernel is compute, and each phase ends with a device synchronisation
so that its kernels fall inside its marker. On CUDA a second table gives, per phase and per
collective kind (NCCL kernel name: AllGather, ReduceScatter, SendRecv for all-to-all, ...), the
exposed fraction of the collectives' time: the part of each NCCL kernel's window during which
no compute kernel runs. (Written for the multi-GPU run and not yet run on several GPUs: on one
H200 the kernel events and markers were checked, but a one-rank NCCL all-reduce launches no
kernel, so the NCCL-by-name classification is unexercised.)
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cpcompile  # noqa: E402

VOCAB = 1024
WRAPPERS = {
    "all_gather": ("sdpa_hf_cp_wrapper", "sdpa_hf_async_cp_wrapper"),
    "ulysses": ("sdpa_hf_ulysses_cp_wrapper", "sdpa_hf_async_ulysses_cp_wrapper"),
    "hybrid": ("sdpa_hf_hybrid_cp_wrapper", "sdpa_hf_async_hybrid_cp_wrapper"),
}


def make_model(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config)


def plan_for(method: str, asynchronous: bool, args) -> dict:
    wrapper = {"_target_": f"cpcompile.wrappers.{WRAPPERS[method][asynchronous]}"}
    if method == "hybrid":
        wrapper["ulysses_degree"] = args.ulysses_degree
    return {
        "accelerator": {"cp_size": dist.get_world_size()},
        "plan_overrides": [{"match": "*.self_attn", "when": "cp", "region_dispatch": False,
                            "inner_target": "self", "inner_wrapper": wrapper}],
    }


def profile_run(method: str, asynchronous: bool, args) -> dict:
    """Compile, warm up, profile; return this rank's overlap figures per phase."""
    from torch.profiler import ProfilerActivity, profile, record_function

    run_dir = Path(args.dump_dir) / f"{method}_{'async' if asynchronous else 'sync'}"
    plan = cpcompile.load_plan(plan_for(method, asynchronous, args))
    cuda = args.device == "cuda"
    mesh = cpcompile.build_mesh(plan.accelerator, device_type=args.device)
    ids = torch.randint(0, VOCAB, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    local = cpcompile.shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh, plan)
    model = make_model(args).to(args.device, torch.bfloat16 if cuda else torch.float32)
    model = cpcompile.compile(model, mesh, plan, example_inputs=local,
                              dump_dir=run_dir / "graphs")  # graphs/rank<r>
    torch._dynamo.reset()
    runner = torch.compile(model) if args.compile else model

    def step():
        with record_function("cp_forward"):
            loss = runner(**local).loss
            if cuda:
                torch.cuda.synchronize()
        with record_function("cp_backward"):
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)

    for _ in range(2 if args.compile else 1):  # warm-up (compiled: the forward, then the backward)
        step()
    dist.barrier()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
    prof.export_chrome_trace(str(run_dir / f"trace_rank{dist.get_rank()}.json"))
    figures = overlap_by_phase(prof.events(), args.steps, cuda)
    if cuda:
        figures["by_kind"] = exposure_by_kind(prof.events(), args.steps)
    return figures


def comm_and_compute(events, cuda: bool) -> tuple[list, list]:
    """Communication and compute windows: gloo worker events vs main-thread aten ops on CPU; NCCL
    kernels vs all other kernels on the GPU timeline."""
    if cuda:
        from torch.autograd import DeviceType

        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        if not kernels:
            raise RuntimeError("the profiler recorded no CUDA kernel events: cannot measure GPU overlap")
        is_comm = [("nccl" in e.name.lower()) for e in kernels]
        return ([window(e) for e, c in zip(kernels, is_comm) if c],
                [window(e) for e, c in zip(kernels, is_comm) if not c])
    main = next(e.thread for e in events if e.name == "cp_forward")
    return ([window(e) for e in events if e.name.startswith("gloo:")],
            [window(e) for e in events if e.thread == main and e.name.startswith("aten::")])


def overlap_by_phase(events, steps: int, cuda: bool = False) -> dict:
    """{phase: (comm total ms, hidden ms)} per step, from profiler events (see the module doc)."""
    phases = {"forward": "cp_forward", "backward": "cp_backward"}
    main = next(e.thread for e in events if e.name == "cp_forward")
    comm, compute = (union(x) for x in comm_and_compute(events, cuda))
    out = {}
    for phase, marker in phases.items():
        spans = union([window(e) for e in events if e.name == marker and e.thread == main])
        phase_comm = intersect(comm, spans)
        out[phase] = (length(phase_comm) / steps / 1e3, length(intersect(phase_comm, compute)) / steps / 1e3)
    return out


def nccl_kind(name: str) -> str:
    """`ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(...)` -> `ReduceScatter`."""
    for kind in ("AllGather", "ReduceScatter", "AllReduce", "SendRecv", "AllToAll", "Broadcast", "Reduce"):
        if kind in name:
            return kind
    return "other"


def exposure_by_kind(events, steps: int) -> dict:
    """{phase: {collective kind: (comm ms, exposed ms)}} per step on the GPU timeline: the exposed
    part of an NCCL kernel is its window minus the union of compute kernel windows."""
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    compute = union([window(e) for e in kernels if "nccl" not in e.name.lower()])
    main = next(e.thread for e in events if e.name == "cp_forward")
    out = {}
    for phase, marker in {"forward": "cp_forward", "backward": "cp_backward"}.items():
        spans = union([window(e) for e in events if e.name == marker and e.thread == main])
        kinds: dict[str, list[float]] = {}
        for kernel in (e for e in kernels if "nccl" in e.name.lower()):
            inside = intersect([window(kernel)], spans)
            total = length(inside)
            if total:
                figures = kinds.setdefault(nccl_kind(kernel.name), [0.0, 0.0])
                figures[0] += total / steps / 1e3
                figures[1] += (total - length(intersect(inside, compute))) / steps / 1e3
        out[phase] = {kind: tuple(v) for kind, v in kinds.items()}
    return out


def window(event) -> tuple[float, float]:
    return (event.time_range.start, event.time_range.end)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two unions of disjoint sorted intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def report(rows: list[dict], args) -> str:
    world = dist.get_world_size()
    shape = (f"B=1 S={args.seq} (S/cp={args.seq // world}) hidden={args.hidden} heads={args.heads}/{args.kv_heads} "
             f"layers={args.layers}")
    if args.device == "cuda":
        setting = (f"NCCL, CP={world}, {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.steps} profiled "
                   f"steps after {1 + args.compile} warm-up; figures per step, mean over ranks.")
        dtype, rule = "bf16", "overlap = |NCCL kernel windows ∩ other kernel windows| / |NCCL kernel windows|"
    else:
        setting = (f"gloo, CP={world}, {torch.get_num_threads()} intra-op thread(s) per rank, torch {torch.__version__}, "
                   f"{os.cpu_count()} CPU cores shared by all ranks; {args.steps} profiled steps after {1 + args.compile} "
                   "warm-up; figures per step, mean over ranks.")
        dtype, rule = "fp32", "overlap = |gloo windows ∩ main-thread aten windows| / |gloo windows|"
    lines = [
        f"# {args.device.upper()} overlap report, {_dt.date.today().isoformat()}",
        "",
        setting,
        f"Shapes: {shape}, {dtype}. Produced by `benchmarks/overlap_report.py --device {args.device}{' --compile' if args.compile else ''}`; "
        f"traces in `{args.dump_dir}/<method>_<mode>/trace_rank<r>.json`.",
        "",
        f"{rule} (see the script's docstring).",
        "",
        "| method | mode | phase | shapes | comm total ms | hidden ms | overlap % |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        pct = 100 * r["hidden"] / r["comm"] if r["comm"] else 0.0
        lines.append(f"| {r['method']} | {r['mode']} | {r['phase']} | {shape} | {r['comm']:.1f} | {r['hidden']:.1f} | {pct:.0f} |")
    kinds = [r for r in rows if r.get("by_kind")]
    if kinds:
        lines += ["", "Exposed time per collective kind (NCCL kernel window with no compute kernel running), "
                  "mean over ranks:", "", "| method | mode | phase | collective | comm ms | exposed ms | exposed % |",
                  "|---|---|---|---|---:|---:|---:|"]
        for r in kinds:
            for kind, (comm, exposed) in sorted(r["by_kind"].items()):
                pct = 100 * exposed / comm if comm else 0.0
                lines.append(f"| {r['method']} | {r['mode']} | {r['phase']} | {kind} | {comm:.2f} | {exposed:.2f} | {pct:.0f} |")
    return "\n".join(lines) + "\n"


def mean_by_kind(per_rank: list[dict], phase: str) -> dict:
    """The ranks' `exposure_by_kind` figures of one phase, averaged (empty off CUDA)."""
    kinds = {kind for r in per_rank for kind in r.get("by_kind", {}).get(phase, {})}
    return {kind: tuple(sum(r["by_kind"][phase].get(kind, (0.0, 0.0))[i] for r in per_rank) / len(per_rank)
                        for i in range(2)) for kind in kinds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--methods", nargs="+", default=["all_gather", "ulysses"], choices=sorted(WRAPPERS))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ulysses-degree", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="run the model under torch.compile (Inductor): the backward is scheduled too")
    parser.add_argument("--dump-dir", default="overlap_dump")
    parser.add_argument("--out", default=None,
                        help="markdown report (default: benchmarks/results/overlap_<date>_<device>.md)")
    parser.add_argument("--append", action="store_true", help="add this run's table to --out instead of replacing it")
    args = parser.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rows = []
    for method in args.methods:
        for asynchronous in (False, True):
            figures = profile_run(method, asynchronous, args)
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, figures)
            for phase in ("forward", "backward"):
                comm = sum(r[phase][0] for r in per_rank) / len(per_rank)
                hidden = sum(r[phase][1] for r in per_rank) / len(per_rank)
                rows.append({"method": method, "mode": "async" if asynchronous else "sync", "phase": phase,
                             "comm": comm, "hidden": hidden, "by_kind": mean_by_kind(per_rank, phase)})
    if dist.get_rank() == 0:
        text = report(rows, args)
        out = Path(args.out or ROOT / "benchmarks" / "results" / f"overlap_{_dt.date.today().isoformat()}_{args.device}.md")
        out.parent.mkdir(parents=True, exist_ok=True)
        if args.append and out.exists():
            text = out.read_text() + "\n" + text
        out.write_text(text)
        print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
