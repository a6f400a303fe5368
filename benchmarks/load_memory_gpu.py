"""Device and host memory of one rank of a CP=N job while the trainer loads pretrained weights,
on one GPU (issue 33: no rank may hold a full copy of the model).

    python benchmarks/load_memory_gpu.py                       # cp N in 2,4,8 and dp_shard 2 x cp N/2, one GPU
        [--simulate-cp 2,4,8] [--dp-shard 1,2] [--seq-len 4096] [--step] [--max-seconds 450] [--out FILE]
    python benchmarks/load_memory_gpu.py --device cpu --small --simulate-cp 4 --dp-shard 2   # smoke, host only

load_memory.py measures host memory with real gloo ranks on CPU; one GPU cannot hold N real ranks,
so here one process plays rank r of the N-rank job under PyTorch's fake process group (as
simulate_cp.py does): the trainer builds exactly what rank r builds (the model on the meta device,
the CP rewrite on fake parameters, FSDP2 over all N ranks, `materialize`) and loads its own
slices of the safetensors (`weights.load_pretrained`). Its memory is real; its collectives return
at once with garbage, which the build survives (cpcompile's agreement gathers start from this
rank's own digests, so a group that communicates nothing agrees). DCP's load does not: it
exchanges every rank's read plan as pickled objects, which come back empty. So the load here plans
this rank's reads alone (`dcp.load(no_dist=True)`): the same read items (its own DTensor slices),
only the exchange of plans (metadata) skipped. Each row then checks its shard against the files
(`loaded = file`: every parameter's local values equal its slice, read again).

The model: the 0.57B Qwen3.5-shaped model of trainer_gpu.py (`--small`: its tiny twin) with
random weights, saved once in bfloat16 to a temporary folder (finetune_gpu.py's save_checkpoint);
trainer_gpu.py's plan (GDN State-P2P, SDPA AllGather), float32 parameters, synthetic data,
`--seq-len` tokens per sequence (one sequence per dp_shard replica): the build and the load are
measured, not a step (`--step` adds one step and its peak).

Rows: ranks 0 and N-1 of each N of `--simulate-cp` at each `--dp-shard` d dividing N with cp = N/d
>= 2, each in a fresh subprocess (its peaks its own). Per row: the rank's shard (its parameters'
local bytes); `torch.cuda.max_memory_allocated`, reset before the build, read at the end of the
build (before the load) and after the load (so over build and load); the memory allocated after
the load; that load peak against the full model in float32 and against 1/N of it; the host's
resident memory (load_memory.py's meter, sampled every millisecond) at its peak during the build
and during the load, above its figure at the build's start (the CUDA context is made before that
start), and the anonymous (private) part's peak during the load (the rest are the mapped
safetensors pages: page cache, shared, reclaimable). On CPU the device columns are n/a.

One H200, the defaults (10 rows): about 5-8 minutes, the model's save included; `--step` adds the
first Triton compile of the GDN kernels to the first row. Rows past `--max-seconds` say so.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MIB = 2.0 ** 20
NA = "n/a"


def row_specs(sizes: list[int], dp_shards: list[int]) -> list[dict]:
    """Every (N, dp_shard, rank) row: ranks 0 and N-1 of each N, at each dp_shard that divides N
    and leaves cp >= 2 (a CP rewrite to measure)."""
    specs = []
    for n in sorted(sizes):
        for dp_shard in sorted(dp_shards):
            if n % dp_shard == 0 and n // dp_shard >= 2:
                specs += [{"n": n, "dp_shard": dp_shard, "rank": rank} for rank in sorted({0, n - 1})]
    return specs


def train_config(args, folder: str, spec: dict) -> dict:
    """trainer_gpu.py's config (plan, precision, AC, loss) on the saved folder at this row's mesh."""
    from trainer_gpu import config

    shape = argparse.Namespace(cp=spec["n"] // spec["dp_shard"], small=args.small, steps=1, seq_len=args.seq_len,
                               gdn_backend=None, device=args.device, loss_chunk_tokens=4096, compile_backend=None)
    raw = config(shape)
    raw["model"] = {"path": folder}
    raw["accelerator"]["dp_shard_size"] = spec["dp_shard"]
    raw["train"]["batch_size"] = spec["dp_shard"]  # the global batch: one sequence per replica
    return raw


# ------------------------------------------------------------------------------------ child


@contextlib.contextmanager
def local_load_planning():
    """DCP's load with `no_dist=True`: this rank plans its own reads (module doc: the fake process
    group cannot carry DCP's exchange of pickled plans)."""
    import torch.distributed.checkpoint as dcp

    load = dcp.load
    dcp.load = lambda *a, **k: load(*a, **{**k, "no_dist": True})
    try:
        yield
    finally:
        dcp.load = load


class DeviceMemory:
    """The caching allocator's figures in MiB on cuda; n/a on CPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda"
        self.torch = torch
        if self.cuda:  # the context first, so the host's start figure already holds it
            torch.empty(1, device="cuda")

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self):
        if not self.cuda:
            return NA
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated() / MIB

    def allocated(self):
        return self.torch.cuda.memory_allocated() / MIB if self.cuda else NA


def measure_rank(args, spec: dict) -> dict:
    """Rank `spec["rank"]` of `spec["n"]` under the fake process group: build, load (measured),
    check the shard against the files, optionally one step; -> the row."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cpcompile.trainer import load_train_config, loop
    from load_memory import Meter

    dist.init_process_group("fake", store=FakeStore(), rank=spec["rank"], world_size=spec["n"])
    config = load_train_config(train_config(args, args.folder, spec))
    device, host = DeviceMemory(args.device), Meter()
    row, load = dict(spec), loop.load_pretrained

    def measured_load(model, folder):
        row["build_peak"], row["host_build"] = device.peak(), host.peak()["VmRSS"] - row["host_start"]
        host.reset()  # the load's own host peak; the device's stays the peak since the build's start
        with local_load_planning():
            load(model, folder)
        row["load_peak"], row["allocated"] = device.peak(), device.allocated()
        peak = host.peak()
        row["host_load"], row["anon_load"] = peak["VmRSS"] - row["host_start"], peak["RssAnon"] - row["anon_start"]

    loop.load_pretrained = measured_load
    device.reset()
    start = host.reset()
    row["host_start"], row["anon_start"] = start["VmRSS"], start["RssAnon"]
    trainer = loop.build_trainer(config)
    host.running = False
    params = list(trainer.model.parameters())
    row["params"] = sum(p.numel() for p in params)  # global sizes (DTensors)
    row["shard"] = sum(p.to_local().numel() * p.element_size() for p in params) / MIB
    row["loaded"] = loaded_as_stored(trainer.model, args.folder)
    if args.step:
        device.reset()
        trainer.step(0)
        row["step_peak"] = device.peak()
    dist.destroy_process_group()
    return row


def loaded_as_stored(model, folder: str) -> str:
    """"yes" when every parameter's local values equal its slice of the safetensors (read again,
    converted to the parameter's dtype), else the first that differs."""
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from cpcompile.trainer.weights import match_tensors, meta_twin, stored_tensors

    state = get_model_state_dict(model)
    names = match_tensors(meta_twin(model), {k: tuple(v.shape) for k, v in state.items()}, folder)
    stored = stored_tensors(folder)
    with contextlib.ExitStack() as stack:
        files = {path: stack.enter_context(safe_open(path, framework="pt")) for path in {s.file for s in stored.values()}}
        for target, key in names.items():
            value = state[target]
            if isinstance(value, DTensor):
                shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
                value = value.to_local()
            else:  # a tensor FSDP2 does not shard (none in these models): whole on every rank
                shape, offset = value.shape, (0,) * value.dim()
            part = files[stored[key].file].get_slice(key)[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
            if not torch.equal(value.cpu(), part.to(value.dtype)):
                return f"no: {target}"
    return "yes"


# ----------------------------------------------------------------------------------- parent


def run_rows(args, argv: list[str]) -> list[dict]:
    """Every row in its own subprocess (this script with `--row SPEC --folder PATH`), within
    `args.max_seconds`; -> the rows, each the child's dict or one with a `note`."""
    from simulate_cp import MIN_ROW_SECONDS, run_child

    start, rows = time.perf_counter(), []
    for spec in row_specs(args.simulate_cp, args.dp_shard):
        left = args.max_seconds - (time.perf_counter() - start)
        if left < MIN_ROW_SECONDS:
            rows.append({**spec, "note": "not run: over the --max-seconds budget"})
        else:
            command = [sys.executable, os.path.abspath(__file__), *argv, "--row", json.dumps(spec),
                       "--folder", args.folder]
            rows.append(run_child(spec, command, left))
        print(f"[{time.perf_counter() - start:.0f} s] {describe(rows[-1])}", flush=True)
    return rows


def describe(row: dict) -> str:
    where = f"N={row['n']} dp_shard {row['dp_shard']} rank {row['rank']}"
    if "note" in row:
        return f"{where}: {row['note']}"
    return f"{where}: shard {_mib(row['shard'])} MiB, load peak {_mib(row['load_peak'])} MiB, loaded = file {row['loaded']}"


def table(rows: list[dict], full_mib: float, step: bool) -> str:
    head = ["rank", "N", "dp_shard", "cp", "shard MiB", "build peak device MiB", "load peak device MiB",
            "allocated after load MiB", "load peak / full model", "load peak / (full / N)",
            "host RSS peak above start MiB (build, load)", "host anon peak above start MiB (load)",
            "loaded = file"] + (["step peak device MiB"] if step else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        first = [str(row["rank"]), str(row["n"]), str(row["dp_shard"]), str(row["n"] // row["dp_shard"])]
        if "note" in row:
            cells = first + [row["note"]] + [""] * (len(head) - len(first) - 1)
        else:
            peak = row["load_peak"]
            cells = first + [_mib(row["shard"]), _mib(row["build_peak"]), _mib(peak), _mib(row["allocated"]),
                             _ratio(peak, full_mib), _ratio(peak, full_mib / row["n"]),
                             f"{row['host_build']:.0f}, {row['host_load']:.0f}", f"{row['anon_load']:.0f}",
                             row["loaded"]]
            cells += [_mib(row.get("step_peak", NA))] if step else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mib(value) -> str:
    """MiB: whole ones, or two decimals below 10 (the tiny model's)."""
    return value if value == NA else f"{value:.0f}" if value >= 10 else f"{value:.2f}"


def _ratio(value, reference: float) -> str:
    return value if value == NA else f"{value / reference:.2f}"


def report(args, rows: list[dict], device_name: str, command: str) -> str:
    import torch

    measured = [r for r in rows if "note" not in r]
    params = measured[0]["params"] if measured else 0
    full_mib = params * 4 / MIB
    model = "tiny Qwen3.5-shaped model" if args.small else "0.57B Qwen3.5-shaped model of trainer_gpu.py"
    return (f"# Memory of one rank loading pretrained weights, CP=N on one device — {_dt.date.today().isoformat()}\n\n"
            f"{device_name}, torch {torch.__version__}. The {model}: {params / 1e6:.1f} M parameters, saved in bfloat16; "
            f"the full model in float32 is {_mib(full_mib)} MiB. One process plays rank r of the N-rank job under the fake "
            f"process group (build on meta, CP rewrite on fake parameters, FSDP2 over N ranks, the load of its own "
            f"slices; benchmarks/load_memory_gpu.py says how). {args.seq_len} tokens a sequence. Device: "
            f"max_memory_allocated reset before the build; the build peak read before the load, the load peak after it "
            f"(the peak over build and load). Host: peaks above the RSS at the build's start.\n\n"
            f"`{command}`\n\n" + table(rows, full_mib, args.step) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="trainer_gpu.py's tiny model (smoke runs)")
    parser.add_argument("--simulate-cp", default="2,4,8", help="comma-separated world sizes N")
    parser.add_argument("--dp-shard", default="1,2", help="comma-separated dp_shard sizes (cp = N / dp_shard >= 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (4096; --small: 256)")
    parser.add_argument("--step", action="store_true", help="one training step after the load, its peak too")
    parser.add_argument("--max-seconds", type=float, default=450.0, help="for all rows; rows past it say so")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/load_memory_gpu_<date>_<device>.md")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one row, in a child process
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)  # the saved model, for a child
    args = parser.parse_args()
    args.seq_len = args.seq_len or (256 if args.small else 4096)
    if args.row:
        from simulate_cp import ROW_MARK

        print(ROW_MARK + json.dumps(measure_rank(args, json.loads(args.row))), flush=True)
        return
    argv = sys.argv[1:]
    args.simulate_cp = [int(n) for n in args.simulate_cp.split(",")]
    args.dp_shard = [int(d) for d in args.dp_shard.split(",")]
    from finetune_gpu import save_checkpoint
    from trainer_gpu import MODEL, SMALL

    with tempfile.TemporaryDirectory(prefix="cpcompile_load_memory_") as folder:
        started = time.perf_counter()
        size_gib = save_checkpoint(folder, SMALL if args.small else MODEL)
        print(f"saved the model in bfloat16 ({size_gib:.2f} GiB) in {time.perf_counter() - started:.0f} s", flush=True)
        args.folder = folder
        rows = run_rows(args, argv)
    import torch

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    text = report(args, rows, device_name, "python benchmarks/load_memory_gpu.py " + " ".join(argv))
    print("\n" + text)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"load_memory_gpu_{_dt.date.today().isoformat()}_"
                                                                   f"{device_name.replace(' ', '-')}.md")
    with open(out, "w", encoding="utf-8") as handle:
        handle.write(text)
    print("wrote", out)


if __name__ == "__main__":
    sys.exit(main())
