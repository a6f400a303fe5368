"""Host memory of a rank while the trainer loads pretrained weights (`model.path`), CPU / gloo.

    OMP_NUM_THREADS=1 python benchmarks/load_memory.py [--hidden 1024] [--layers 12] [--vocab 32000] [--out FILE]

A Qwen3 of ~220M parameters (the defaults) is built from its config with random weights and
written by `save_pretrained` (float32, one safetensors file) into a temporary folder. Then the
trainer is built on it, each rank in a fresh process, with the model's parameters on the meta
device (`trainer/weights.py`), sharded by FSDP2 over every rank, each rank loading its shard
from the file:
- dp_shard 2, cp 1 (2 ranks): no CP rewrite;
- cp 2 (dp_shard 1, SDPA AllGather; 2 ranks): the CP rewrite runs first, its probe forward and
  traces on fake parameters (`cpcompile/meta_params.py`), so a rank holds no more than at cp 1;
- dp_shard 2 x cp 2 (4 ranks): the same with quarter shards.

Per rank, from `/proc/self/status` (sampled every millisecond; the whole RSS also from the
kernel's own peak, VmHWM, reset through /proc/self/clear_refs where allowed): the anonymous
(private) resident memory at the start of the build, at its peak during the build (before the
load) and during the load; the file pages mapped during the load (the safetensors file is
memory-mapped: the pages a rank reads count, and are the kernel's page cache, shared and
reclaimable); and the peak RSS above the start against the full model (its float32 parameters).
`from_pretrained` in one process, its parameters then read once, is shown for comparison.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MIB = 2.0 ** 20
FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def status() -> dict[str, float]:
    """This process's memory figures from /proc/self/status, in MiB."""
    values = {}
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                values[key] = int(rest.split()[0]) * 1024 / MIB
    return values


class Meter:
    """Peaks since `reset()` of the resident memory: its anonymous (private) and file-backed
    (mapped safetensors pages) parts, sampled every millisecond, and the whole (VmRSS), also from
    the kernel's own peak (VmHWM) where /proc/self/clear_refs lets it be reset."""

    def __init__(self):
        self.peaks = status()
        self.kernel_peak_reset = False
        self.running = True
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self):
        while self.running:
            self._take(status())
            time.sleep(0.001)

    def _take(self, now: dict) -> None:
        self.peaks = {key: max(value, now[key]) for key, value in self.peaks.items()}

    def reset(self) -> dict:
        """Start new peaks; -> the figures now."""
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
                handle.write("5")  # VmHWM := the current RSS
            self.kernel_peak_reset = True
        except OSError:
            self.kernel_peak_reset = False
        self.peaks = now = status()
        return now

    def peak(self) -> dict:
        now = status()
        self._take(now)
        peaks = dict(self.peaks)
        if self.kernel_peak_reset:
            peaks["VmRSS"] = max(peaks["VmRSS"], now["VmHWM"])
        return peaks


def save_model(folder: str, hidden: int, layers: int, vocab: int) -> int:
    """Write the model; -> its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                                  head_dim=hidden // 16, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def train_config(folder: str, cp: int, dp_shard: int) -> dict:
    overrides = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
                  "inner_wrapper": "sdpa_hf"}]
    return {"model": {"path": folder}, "train": {"steps": 1, "seq_len": 64, "batch_size": 2, "dtype": "float32"},
            "accelerator": {"cp_size": cp, "dp_shard_size": dp_shard}, "plan_overrides": overrides}


def rank_main(rank: int, world: int, port: int, config: dict, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from cpcompile.trainer import load_train_config, loop

    meter = Meter()
    figures = {}
    load = loop.load_pretrained

    def measured_load(model, folder):
        figures["build"] = meter.peak()
        meter.reset()
        load(model, folder)
        figures["load"] = meter.peak()

    loop.load_pretrained = measured_load
    config = load_train_config(config)
    figures["start"] = meter.reset()
    trainer = loop.build_trainer(config)
    figures["shard"] = sum(p.to_local().numel() * p.element_size() for p in trainer.model.parameters()) / MIB
    meter.running = False
    results.put((rank, figures))
    dist.barrier()
    dist.destroy_process_group()


def measure(config: dict, world: int) -> dict:
    """Every rank's figures: {rank: {"start" | "build" | "load": status figures, "shard": MiB}}."""
    context = mp.get_context("spawn")  # fresh processes: nothing inherited from this one
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=rank_main, args=(r, world, port, config, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    per_rank = dict(results.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join()
    return per_rank


def from_pretrained_peak(folder: str, results) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401  (imported before the start figure)

    AutoConfig.from_pretrained(folder)
    meter = Meter()
    start = meter.reset()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # transformers may keep float32 parameters as views of the mapped file: read them all, as training would
    sum(p.sum().item() for p in model.parameters())
    results.put({0: {"start": start, "load": meter.peak()}})


def measure_from_pretrained(folder: str) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    proc = context.Process(target=from_pretrained_peak, args=(folder, results))
    proc.start()
    out = results.get(timeout=900)
    proc.join()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(rows: dict[str, dict], full_mib: float) -> str:
    """One line per run and rank: its shard; its anonymous (private) RSS at the start, at the
    build's peak (before the load) and at the load's peak, that peak above the start against the
    full model; the file pages mapped during the load; the whole RSS peak above the start against
    the full model."""
    lines = ["| run | rank | shard | anon at start | anon peak, build | anon peak, load | anon above start / full "
             "model | file pages mapped, load | RSS peak above start / full model |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, per_rank in rows.items():
        for rank, f in sorted(per_rank.items()):
            start, load, build = f["start"], f["load"], f.get("build")
            anon = max(load["RssAnon"], build["RssAnon"] if build else 0.0) - start["RssAnon"]
            whole = max(load["VmRSS"], build["VmRSS"] if build else 0.0) - start["VmRSS"]
            cells = [f"{f['shard']:.0f}" if "shard" in f else "-", f"{start['RssAnon']:.0f}",
                     f"{build['RssAnon']:.0f}" if build else "-", f"{load['RssAnon']:.0f}",
                     f"{anon / full_mib:.2f}", f"{load['RssFile'] - start['RssFile']:.0f}", f"{whole / full_mib:.2f}"]
            lines.append(f"| {name} | {rank} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        params = save_model(folder, args.hidden, args.layers, args.vocab)
        full_mib = params * 4 / MIB
        rows = {"from_pretrained, 1 process": measure_from_pretrained(folder),
                "trainer dp_shard 2, cp 1 (meta build)": measure(train_config(folder, 1, 2), 2),
                "trainer cp 2 (meta build, CP rewrite on fake parameters)": measure(train_config(folder, 2, 1), 2),
                "trainer dp_shard 2 x cp 2 (meta build, CP rewrite)": measure(train_config(folder, 2, 2), 4)}
    date = _dt.date.today().isoformat()
    text = (f"# Host memory of a rank loading pretrained weights — {date}\n\n"
            f"Qwen3, {params / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
            f"float32: the full model is {full_mib:.0f} MiB. MiB of resident memory (RSS) per rank; file pages: "
            f"those mapped during the load above the start (the safetensors pages the rank read).\n\n"
            f"`OMP_NUM_THREADS=1 python benchmarks/load_memory.py --hidden {args.hidden} --layers {args.layers} "
            f"--vocab {args.vocab}`\n\n" + table(rows, full_mib) + "\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
