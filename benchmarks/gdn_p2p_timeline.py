"""Where GDN State-P2P's messages sit among its kernels, forward and backward, on one GPU.

    python3 benchmarks/gdn_p2p_timeline.py [--T 16384] [--world 3] [--rank 1] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/gdn_p2p_timeline.py --smoke   # CPU: the order of messages only

One process plays rank ``--rank`` of a ``--world``-rank cp group under the fake process group and
runs the State-P2P executor op (``cpcompile::gdn_p2p_chunk``, Triton kernels) forward and backward
on the current CUDA device. The fake group's messages move nothing and complete at once, so no wait
time is measured (that needs 2+ GPUs); what shows is the order on the real CUDA timeline: where each
receive is posted (``R``), waited (``W``, the executor's ``gdn_p2p.wait`` range) and each send
issued (``S``) among the executor's phases (``P name``, its ``record_function`` ranges) and the
compute kernels issued in between (``[n kernels, x ms]``, matched to their GPU execution). The
summary counts the compute GPU time issued while a receive was outstanding: the work a rank does
while its neighbour's state (forward) or state gradient (backward) is on its way.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overlap_timeline import (PHASES, classify, kernel_run, percent, phase_sequences,  # noqa: E402
                              sequence_lines)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def classify_p2p(event: dict, gpu_us: dict) -> tuple | None:
    """A trace event -> ("R",) receive posted, ("S",) send, ("W",) a message waited, ("P", phase)
    an executor phase begins, ("K", kernel, gpu_us) a compute kernel; None for anything else."""
    name, category = event["name"], event.get("cat", "")
    if category == "cpu_op" and name == "c10d::recv_":
        return ("R",)
    if category == "cpu_op" and name == "c10d::send":
        return ("S",)
    if category == "user_annotation" and name == "gdn_p2p.wait":
        return ("W",)
    if category == "user_annotation" and name.startswith("gdn_p2p_"):
        return ("P", name.split(".", 1)[1])
    item = classify(event, gpu_us)
    return item if item is not None and item[0] == "K" else None


def summarize_p2p(items: list[tuple]) -> dict:
    """The sequence as text, and the compute GPU time issued while a receive was outstanding."""
    parts: list[str] = []
    kernels, kernel_us = 0, 0.0
    out = {"compute_ms": 0.0, "while_receiving_ms": 0.0}
    receiving = False
    for item in items:
        if item[0] == "K":
            kernels, kernel_us = kernels + 1, kernel_us + item[2]
            out["compute_ms"] += item[2] / 1e3
            out["while_receiving_ms"] += item[2] / 1e3 if receiving else 0.0
            continue
        if kernels:
            parts.append(kernel_run(kernels, kernel_us))
            kernels, kernel_us = 0, 0.0
        if item[0] == "R":
            receiving = True
        elif item[0] == "W" and receiving:
            receiving = False  # the first wait after a posted receive is that receive's
        parts.append(f"P {item[1]}" if item[0] == "P" else item[0])
    if kernels:
        parts.append(kernel_run(kernels, kernel_us))
    return {"sequence": " ".join(parts), **out}


def profile_step(args, device: str) -> dict:
    """Forward + backward of the executor op under the profiler -> the Chrome trace."""
    import cpcompile.kernels.gdn.layer_ops  # noqa: F401  (registers cpcompile::gdn_p2p_chunk)
    from torch.profiler import ProfilerActivity, profile, record_function

    B, Hk, Hv, K, V = args.dims
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)
    q = torch.nn.functional.normalize(rnd(B, args.T, Hk, K), dim=-1).to(dtype).requires_grad_()
    k = torch.nn.functional.normalize(rnd(B, args.T, Hk, K), dim=-1).to(dtype).requires_grad_()
    v = rnd(B, args.T, Hv, V).to(dtype).requires_grad_()
    g = torch.nn.functional.logsigmoid(rnd(B, args.T, Hv) + 2.0).requires_grad_()
    beta = torch.sigmoid(rnd(B, args.T, Hv)).to(dtype).requires_grad_()
    do = rnd(B, args.T, Hv, V).to(dtype)
    group = dist.group.WORLD.group_name

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def step():
        with record_function(PHASES["forward"]):
            o, _ = torch.ops.cpcompile.gdn_p2p_chunk(q, k, v, g, beta, K ** -0.5, 64, group, args.rank, args.world)
            sync()
        with record_function(PHASES["backward"]):
            o.backward(do)
            sync()

    for _ in range(2 if device == "cuda" else 0):  # compile and autotune outside the profile
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    path = Path(args.dump_dir) / "trace_gdn_p2p.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())


def report(rows: list[dict], args, device_name: str) -> str:
    B, Hk, Hv, K, V = args.dims
    lines = [
        f"# GDN State-P2P order on one device, {_dt.date.today().isoformat()}", "",
        f"{device_name}, torch {torch.__version__}; rank {args.rank} of a fake {args.world}-rank cp group (messages "
        f"move nothing and complete at once: order only, no wait time). `cpcompile::gdn_p2p_chunk`, Triton kernels, "
        f"B={B} T={args.T} per rank, Hk/Hv={Hk}/{Hv}, K=V={K}. Produced by `benchmarks/gdn_p2p_timeline.py`.", "",
        "`R` receive posted, `W` a message waited, `S` send issued, `P` an executor phase begins, "
        "`[n kernels, x ms]` GPU time of the compute kernels issued in between.", "",
        "| phase | compute ms | issued while a receive was outstanding, ms | % |", "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['compute_ms']:.2f} | {r['while_receiving_ms']:.2f} | "
                     f"{percent(r['while_receiving_ms'], r['compute_ms']):.0f} |")
    lines += sequence_lines(rows, lambda r: r["phase"])
    return "\n".join(lines)


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, default=16384, help="tokens per rank")
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--rank", type=int, default=1, help="a middle rank receives and sends both ways")
    parser.add_argument("--dump-dir", default="gdn_p2p_timeline_dump")
    parser.add_argument("--out", default=None, help="markdown report (default: benchmarks/results/gdn_p2p_timeline_<date>_<gpu>.md)")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape: the message order only")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.T, args.dims, device, device_name = 96, (1, 1, 2, 16, 16), "cpu", "CPU (Triton interpreter)"
    else:
        args.dims, device = (1, 16, 32, 128, 128), "cuda"
        torch.cuda.set_device(0)
        device_name = torch.cuda.get_device_name()
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    trace = profile_step(args, device)
    rows = [{"phase": phase, **summarize_p2p(phase_sequences(trace, phase, classify_p2p)[-1])} for phase in PHASES]
    dist.destroy_process_group()
    text = report(rows, args, device_name)
    print(text)
    if not args.smoke:
        out = Path(args.out or ROOT / "benchmarks" / "results"
                   / f"gdn_p2p_timeline_{_dt.date.today().isoformat()}_{device_name.replace(' ', '-')}.md")
        out.write_text(text + "\n")
        print("wrote", out)


if __name__ == "__main__":
    main()
