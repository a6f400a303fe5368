"""Fine-tune a checkpoint end to end on one GPU (issue 33's proof): the 0.57B Qwen3.5-shaped model of
trainer_gpu.py saved as a local Hugging Face folder (random weights: nothing can be downloaded),
loaded by `model.path`, fine-tuned on chat data with packing, exported, and read back by transformers.

    python3 benchmarks/finetune_gpu.py [--steps 20 --seq-len 32768 --out FILE] [--profile]
    python3 benchmarks/finetune_gpu.py --small --device cpu --steps 2 --seq-len 256     # smoke run

Steps: (1) build the model from its config, `save_pretrained` it in bfloat16 (as checkpoints are
shipped) with the offline tokenizer of the tests beside it (a byte-level BPE with a ChatML template;
its 320 ids fit the model's vocabulary); (2) write synthetic conversations as JSONL; (3) `cpcompile
train` in this process (cp 1: built on the meta device, each parameter loaded from the safetensors
after FSDP2; float32 parameters, bf16 compute, AC on every layer, the chunked loss, the Triton GDN
core, `checkpoint.export: true`); (4) `from_pretrained` on the export and on the trained weights
(gathered from the run), the logits of both on one row in float32, their largest difference.
Timed: the load (`weights.load_pretrained`), its peak host memory (RSS above the RSS before it,
sampled every millisecond by load_memory.py's meter), each step, the export. A results table goes
to `--out` (default: benchmarks/results/finetune_gpu_<date>_<device>.md). `--profile`: the last step
under PyTorch's profiler, its ops by device time printed (step_profile.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests", "train"))

WORDS = ("context parallel sequence token model layer state gate chunk kernel memory rank gradient "
         "attention delta rule tensor device stream shard export weight loss step").split()


def save_checkpoint(folder: str, model_keys: dict) -> float:
    """The model of `model_keys` with random weights and the tests' tokenizer, saved to `folder`;
    -> the model's size in GiB as saved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenizer_folder import write_tokenizer_folder

    keys = dict(model_keys)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(keys.pop("model_type"), **keys))
    model.to(torch.bfloat16).save_pretrained(folder)
    write_tokenizer_folder(folder)
    return sum(p.numel() for p in model.parameters()) * 2 / 2**30


def write_conversations(path: str, count: int) -> None:
    rng = random.Random(0)

    def sentence():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))).capitalize() + "."

    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(count):
            messages = [{"role": "system", "content": "You answer briefly."}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": sentence()}, {"role": "assistant", "content": sentence()}]
            handle.write(json.dumps({"messages": messages}) + "\n")


def train_config(args, folder: str, data: str, checkpoints: str) -> dict:
    backend = "triton" if args.device == "cuda" else "eager"
    return {"model": {"path": folder},
            "data": {"source": "chat", "path": data, "tokenizer": folder, "packing": True},
            "train": {"steps": args.steps, "seq_len": args.seq_len, "batch_size": 1, "lr": 1e-5, "seed": 0,
                      "dtype": "float32", "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                      "grad_clip": 1.0, "activation_checkpointing": "every_layer", "gdn_backend": backend,
                      "device": args.device},
            "optimizer": {"warmup_steps": 2},
            "checkpoint": {"folder": checkpoints, "interval": 0, "export": True, "resume": False},
            "accelerator": {"cp_size": 1}}


def profiled_last_step(trainer, steps: int, device: str):
    """`trainer` with its last step run under the profiler; the kernel table printed after it."""
    from step_profile import kernel_table

    step = trainer.step

    def step_maybe_profiled(index, *args, **kwargs):
        if index != steps - 1:
            return step(index, *args, **kwargs)
        tables: list[str] = []
        with kernel_table(device, tables):
            record = step(index, *args, **kwargs)
        print(f"profile of step {index + 1}:\n{tables[0]}", flush=True)
        return record

    trainer.step = step_maybe_profiled
    return trainer


def timed_training(config: dict, profile: bool = False):
    """Run the training; -> (records, the trainer, load seconds, load peak RSS above its start, export seconds)."""
    from cpcompile.trainer import load_train_config, loop
    from load_memory import MIB, Meter

    timings, built = {}, []
    load, export, build = loop.load_pretrained, loop.export_from_ranks, loop.build_trainer

    def timed_load(model, folder):
        meter = Meter()  # load_memory.py's: resident memory sampled every millisecond
        before = meter.reset()["VmRSS"]
        start = time.perf_counter()
        load(model, folder)
        timings["load_s"] = time.perf_counter() - start
        timings["load_rss_gib"] = (meter.peak()["VmRSS"] - before) * MIB / 2**30
        timings["rss_before_load_gib"] = before * MIB / 2**30
        meter.running = False

    def timed_export(*a, **k):
        start = time.perf_counter()
        export(*a, **k)
        timings["export_s"] = time.perf_counter() - start

    loop.load_pretrained, loop.export_from_ranks = timed_load, timed_export
    steps, device = config["train"]["steps"], config["train"]["device"]
    made = (lambda *a, **k: profiled_last_step(build(*a, **k), steps, device)) if profile else build
    loop.build_trainer = lambda *a, **k: built.append(made(*a, **k)) or built[-1]
    try:
        records = loop.train(load_train_config(config), log=lambda line: print(line, flush=True))
    finally:
        loop.load_pretrained, loop.export_from_ranks, loop.build_trainer = load, export, build
    return records, built[0], timings


def logits_difference(trainer, exported: str, folder: str, device: str, tokens: int) -> tuple[float, float]:
    """from_pretrained(export) against the trained weights (gathered) in one float32 model each, on
    `tokens` ids; -> (largest |difference|, largest |logit|)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    weights = {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
               for name, p in trainer.model.named_parameters()}
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    missing, _ = trained.load_state_dict({k: v.float().cpu() for k, v in weights.items()}, strict=False)
    assert not [m for m in missing if not m.startswith("lm_head") or trained.config.tie_word_embeddings is False], missing
    del weights
    reread = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    ids = torch.randint(0, 320, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        a = trained.to(device)(input_ids=ids).logits
        trained.cpu()
        b = reread.to(device)(input_ids=ids).logits
    return (a - b).abs().max().item(), a.abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--logit-tokens", type=int, default=512)
    parser.add_argument("--work", default=None, help="folder for the checkpoint, data and run (default: a temp dir)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="profile the last step; print its ops by device time")
    args = parser.parse_args()

    import torch

    from trainer_gpu import MODEL, SMALL
    from tokenizer_folder import VOCAB_SIZE

    keys = dict(SMALL if args.small else MODEL)
    keys["vocab_size"] = max(keys["vocab_size"], VOCAB_SIZE)
    work = args.work or tempfile.mkdtemp(prefix="cpcompile_finetune_")
    folder, data, checkpoints = (os.path.join(work, n) for n in ("checkpoint", "chat.jsonl", "run"))
    start = time.perf_counter()
    size_gib = save_checkpoint(folder, keys)
    save_s = time.perf_counter() - start
    write_conversations(data, count=max(200, args.steps * args.seq_len // 150))
    records, trainer, t = timed_training(train_config(args, folder, data, checkpoints), args.profile)
    exported = os.path.join(checkpoints, "hf")
    diff, scale = logits_difference(trainer, exported, folder, args.device, args.logit_tokens)
    # compiled layers run a new batch signature eagerly first and compile at its second call
    # (cpcompile.compiled): steps 1 and 2 are that one-off work
    timed = records[2:] or records[1:] or records
    first_timed = len(records) - len(timed) + 1
    seconds = sum(r["seconds"] for r in timed) / len(timed)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peaks = [r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None]
    lines = [f"# Fine-tune a checkpoint end to end — {datetime.date.today().isoformat()}, {device}", "",
             f"Command: `python3 benchmarks/finetune_gpu.py --steps {args.steps} --seq-len {args.seq_len}"
             f"{' --small' if args.small else ''}`; torch {torch.__version__}.", "",
             "| what | value |", "|---|---|",
             f"| model | {sum(p.numel() for p in trainer.model.parameters()) / 1e6:.1f} M parameters, saved in bfloat16 "
             f"({size_gib:.2f} GiB, {save_s:.1f} s to build and save) |",
             f"| load (`weights.load_pretrained`, after FSDP2, into float32) | {t['load_s']:.2f} s |",
             f"| host memory during the load, peak RSS above the RSS before it | {t['load_rss_gib']:.2f} GiB "
             f"(RSS before: {t['rss_before_load_gib']:.2f} GiB) |",
             f"| steps × tokens | {len(records)} × {args.seq_len} (chat, packed, loss on assistant tokens) |",
             f"| loss, first → last | {records[0]['loss']:.4f} → {records[-1]['loss']:.4f} |",
             f"| tokens/s (steps {first_timed}..) | {args.seq_len / seconds:.0f} ({seconds:.3f} s/step) |",
             f"| peak GPU memory | {max(peaks):.2f} GiB |" if peaks else "| peak GPU memory | - |",
             f"| export (`checkpoint.export`) | {t['export_s']:.2f} s |",
             f"| from_pretrained(export) vs the trained weights, float32 logits of {args.logit_tokens} tokens | "
             f"max abs diff {diff:.3g} (largest logit {scale:.3g}) |"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"finetune_gpu_{datetime.date.today().isoformat()}_{device.replace(' ', '-')}.md")
    with open(out, "w", encoding="utf-8") as handle:
        handle.write(text)
    print("wrote", out)
    if not diff <= 1e-6 * max(1.0, scale):
        sys.exit("FAIL: the export's logits are not the trained model's")


if __name__ == "__main__":
    main()
