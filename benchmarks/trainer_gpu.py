"""The trainer on GPU (issue 15 item 7): a Qwen3.5-shaped model of ~0.5B parameters, 32K tokens a
step, activation checkpointing + FSDP2 + CP, 20 steps; tokens/s, MFU and peak memory.

    python benchmarks/trainer_gpu.py                                   # one GPU, cp 1
    torchrun --nproc-per-node 2 benchmarks/trainer_gpu.py --cp 2       # two GPUs, cp 2
    options: --steps 20 --seq-len 32768 --ac every_layer --loss chunked --loss-chunk-tokens 4096
             --compile-backend inductor --dry-run
    python benchmarks/trainer_gpu.py --small --device cpu --steps 2     # a smoke run of the script on CPU

`--loss` and `--ac` take comma-separated lists (`--loss chunked,full --ac off,every_layer,every_n:2,selective`;
`every_n:K` is the YAML `activation_checkpointing: {every_n: K}`, and the config says which modes
it knows): every combination is built and run in turn in the same processes, and a table of one row
per mode ends the output (tokens/s after the first step, peak allocated memory of rank 0, MFU).
On one process a mode that runs out of GPU memory is a row saying so and the next mode runs; under
torchrun the other ranks would wait for the one that failed, so there it ends the run.

No network: the model is built from a config (random weights), the data are synthetic. Mixed
precision: float32 parameters, FSDP2 computing in bfloat16 and reducing in float32; GDN layers on
cpcompile's Triton core (with cp 1 too); SDPA AllGather and GDN State-P2P under CP. Every step
prints its peak allocated memory; the last line is the summary with MFU, counted as
6 x (matmul parameters, the head's included) + the causal attention term per token, against `--peak-tflops`
(H200 dense bf16: 989), without the activation-checkpointing recompute.

    python benchmarks/trainer_gpu.py --simulate-cp 2,4,8,16 [--tokens 128K,256K,512K,1M]
        [--sdpa all_gather,ulysses,head_tail] [--warmup 2 --steps 2] [--ranks ends|first|last] [--max-seconds 540]
        [--bandwidth-gbps 450] [--profile]

`--simulate-cp` plays, on one device, rank 0 and the last rank of a CP=N job under PyTorch's fake
process group, one subprocess per row: real memory and compute, zero communication, the bytes each
rank sends counted from its collectives, and the CP=N step predicted from them (simulate_cp.py
says how; collective_bytes.py the byte formulas). GDN runs State-P2P; SDPA AllGather, Ulysses or
Head-Tail (`--sdpa`; Ulysses where the heads allow: the rows say which N cpcompile refuses; with
Head-Tail the GDN layers run State-P2P in Head-Tail order, one batch order for the whole model). Each row also has
the trainer's memory estimate (`memory_estimate`, what `--dry-run` prints) beside the measured peak.
With `--profile` each row runs one step more, under the profiler, and prints its ops by device time.
Smoke: `--simulate-cp 2 --small --device cpu --tokens 64`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cpcompile.trainer.sdpa_backend import SDPA_BACKENDS  # noqa: E402

MODEL = dict(model_type="qwen3_5_text", vocab_size=151936, hidden_size=1024, intermediate_size=3584,
             num_hidden_layers=20, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
             linear_num_value_heads=16, linear_conv_kernel_dim=4, tie_word_embeddings=True)


SMALL = dict(MODEL, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


def config(args, loss: str = "chunked", ac="every_layer", sdpa: str = "sdpa_hf", gdn: str = "p2p") -> dict:
    """The train config; `sdpa` the attention layers' wrapper, `gdn` the GDN method (`p2p`, or
    `p2p_head_tail` beside SDPA Head-Tail: one batch order)."""
    backend = args.gdn_backend or ("triton" if args.device == "cuda" else "eager")
    plan = {"accelerator": {"cp_size": args.cp}, "plan_overrides": [
        {"match": "*.linear_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
         "inner_wrapper": {"_target_": f"cpcompile.adapters.qwen3_5.qwen3_5_gdn_{gdn}_cp_wrapper", "backend": backend}},
        {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
         "inner_wrapper": sdpa}]}
    return {"model": SMALL if args.small else MODEL, **plan,
            "train": {"steps": args.steps, "seq_len": args.seq_len, "batch_size": 1, "lr": 3e-4, "seed": 0,
                      "dtype": "float32", "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                      "grad_clip": 1.0, "activation_checkpointing": ac, "gdn_backend": backend,
                      "loss": loss, "loss_chunk_tokens": args.loss_chunk_tokens,
                      "compile_backend": args.compile_backend, "device": args.device,
                      "gdn_checkpoint_around_core": getattr(args, "gdn_checkpoint_around_core", False),
                      "offload_layer_inputs": getattr(args, "offload_layer_inputs", False),
                      "sdpa_backend": getattr(args, "sdpa_backend", None), "verify": getattr(args, "verify", False)},
            "optimizer": {"warmup_steps": 2}}


def flops_per_token(model, seq_len: int) -> float:
    """6 x (the parameters of every matmul, the head's included; not the embedding lookup) + the causal
    attention term: 6 x attention layers x seq_len x heads x head_dim (QK^T and PV over seq_len / 2 keys
    on average, forward + backward). No activation-checkpointing recompute."""
    text = model.config.get_text_config()
    total = sum(p.numel() for p in model.parameters())  # a tied head is counted once, as the embedding
    embedding = text.vocab_size * text.hidden_size
    head = 0 if getattr(text, "tie_word_embeddings", False) else text.vocab_size * text.hidden_size
    matmul = total - embedding - head + text.vocab_size * text.hidden_size
    attention_layers = sum(1 for kind in text.layer_types if kind == "full_attention")
    return 6 * matmul + 6 * attention_layers * seq_len * text.num_attention_heads * text.head_dim


def ac_setting(name: str):
    """`every_n:K` -> `{"every_n": K}` (the YAML mapping); any other name as it is."""
    kind, _, k = name.partition(":")
    return {kind: int(k)} if k else name


def run_mode(args, loss: str, ac: str) -> dict:
    """Build the trainer for one (loss, AC) mode and run its steps; -> its table row."""
    import torch

    from cpcompile.trainer import dry_run, load_train_config
    from cpcompile.trainer.dry_run_report import memory_estimate
    from cpcompile.trainer.loop import build_trainer
    from cpcompile.trainer.metrics import format_step, summary, timed_steps, warmup_steps
    from cpcompile.trainer.parallelize import is_rank_zero

    train_config = load_train_config(config(args, loss, ac_setting(ac)))
    if args.dry_run:
        dry_run(train_config, memory_gib=args.memory_gib)
        return {"loss": loss, "ac": ac, "note": "dry run"}
    trainer = build_trainer(train_config)
    if args.pad_fraction:
        pad_rows(trainer.stream, args.pad_fraction)
    per_token = flops_per_token(trainer.model, args.seq_len)
    if is_rank_zero():
        params = sum(p.numel() for p in trainer.model.parameters())
        estimate = memory_estimate(train_config, params, trainer.model.config)
        print(f"{params / 1e6:.1f} M parameters, {args.seq_len} tokens/step, cp {args.cp}, loss {loss}, AC {ac}, "
              f"{per_token / 1e9:.2f} GFLOP/token; memory estimate per rank "
              + ", ".join(f"{k} {v:.3g} GiB" for k, v in estimate.items()), flush=True)
    records = []
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for index in range(args.steps):
        with profiled(args.profile and index == args.steps - 1, args.device):
            records.append(trainer.step(index))
        if is_rank_zero():
            print(format_step(records[-1], args.steps) + verdict(records[-1], train_config), flush=True)
    peak_flops = args.peak_tflops * 1e12 * args.cp
    warmup = warmup_steps(train_config.train.layer_compile_backend() is not None)
    if is_rank_zero():
        print(summary(records, args.seq_len, per_token, peak_flops, warmup), flush=True)
    timed = timed_steps(records, warmup)
    seconds = sum(r["seconds"] for r in timed) / len(timed)
    peaks = [r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None]
    real_tokens = args.seq_len - int(args.seq_len * args.pad_fraction)  # tokens/s counts the real ones
    return {"loss": loss, "ac": ac, "tokens_per_s": real_tokens / seconds, "seconds": seconds,
            "peak_gib": max(peaks) if peaks else None, "mfu": per_token * args.seq_len / seconds / peak_flops}


def pad_rows(stream, fraction: float) -> None:
    """Right-pad every synthetic row: its last `fraction` of tokens masked and their labels ignored, as
    a padded fine-tuning batch is (the padded step of issue 48; tokens/s then counts real tokens)."""
    from cpcompile.batch import IGNORE_INDEX

    row = stream.row

    def padded(index: int):
        ids, mask, labels = row(index)
        cut = len(ids) - int(len(ids) * fraction)
        mask, labels = mask.clone(), labels.clone()  # a synthetic row's labels are its ids
        mask[cut:] = 0
        labels[cut:] = IGNORE_INDEX
        return ids, mask, labels

    stream.row = padded


@contextlib.contextmanager
def profiled(enabled: bool, device: str):
    """With --profile, around the last step: its kernels by device time (step_profile.py), printed
    by rank 0."""
    if not enabled:
        yield
        return
    import torch

    from step_profile import kernel_table

    tables: list[str] = []
    with kernel_table(device, tables):
        yield
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(tables[0], flush=True)


def verdict(record: dict, train_config) -> str:
    """With --verify: the step's judgement against the unrewritten copies (the trainer's `verify`:
    bf16 within cpcompile/parity.py's bound of the bf16 copy's distance from the float32 copy)."""
    from cpcompile.trainer.verify import step_failure

    if not train_config.train.verify:
        return ""
    failure = step_failure(record, train_config.train, train_config.plan.cp_size)
    return f"  verify: {'PASS' if failure is None else 'FAIL: ' + failure}"


def release_memory(device: str) -> None:
    """What the last mode left: collected, and the CUDA cache emptied, so the next one's peak is its own."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    lines = ["| loss | AC | tokens/s | s/step | peak GiB (rank 0) | MFU |", "|---|---|---|---|---|---|"]
    for row in rows:
        if "note" in row:
            lines.append(f"| {row['loss']} | {row['ac']} | {row['note']} | | | |")
            continue
        peak = f"{row['peak_gib']:.2f}" if row["peak_gib"] is not None else "-"
        lines.append(f"| {row['loss']} | {row['ac']} | {row['tokens_per_s']:.0f} | {row['seconds']:.3f} | {peak} | "
                     f"{100 * row['mfu']:.1f}% |")
    return "\n".join(lines)


def simulate(args, parser) -> None:
    """`--simulate-cp`: the parent runs every row in a child process (`--simulate-row`)."""
    import simulate_cp

    if "," in args.loss or "," in args.ac:
        parser.error("--simulate-cp runs one --loss and one --ac mode")
    args.steps = 2 if args.steps is None else args.steps
    if args.warmup < 1 or args.steps < 1:
        parser.error("--simulate-cp needs --warmup >= 1 (the first step is no typical step) and --steps >= 1")
    if args.simulate_row:
        from cpcompile.trainer import load_train_config

        def train_config_for(child_args, sdpa_wrapper, gdn_method):
            # the run's LR schedule covers the warm-up, the measured steps and one more (profiled, or
            # counting the bytes of compiled layers: simulate_cp.run_row)
            steps = child_args.warmup + child_args.steps + 1
            scheduled = argparse.Namespace(**{**vars(child_args), "steps": steps})
            return load_train_config(config(scheduled, scheduled.loss, ac_setting(scheduled.ac), sdpa_wrapper,
                                            gdn_method))

        return simulate_cp.child_main(args, args.simulate_row, train_config_for)
    args.simulate_cp = [int(n) for n in args.simulate_cp.split(",")]
    args.tokens = simulate_cp.parse_tokens(args.tokens or ("64,128" if args.small else "128K,256K,512K,1M"))
    args.sdpa = args.sdpa.split(",")
    unknown = [m for m in args.sdpa if m not in simulate_cp.SDPA_WRAPPERS]
    if unknown or any(n < 2 for n in args.simulate_cp):
        parser.error(f"--sdpa takes {', '.join(simulate_cp.SDPA_WRAPPERS)}; --simulate-cp sizes are >= 2")
    rows = simulate_cp.run_all(args, sys.argv[1:], os.path.abspath(__file__))
    in_measured = simulate_cp.counted_step(args.warmup) >= args.warmup
    counted = "the first measured step" if in_measured else "the last warm-up step"
    print(f"\nPer rank ({'tiny model' if args.small else 'Qwen3.5-shaped 0.57B'}, {args.device}, loss {args.loss}, "
          f"AC {args.ac}, warm-up {args.warmup} + {args.steps} measured steps, bytes counted in "
          f"{counted}, "
          f"comm at {args.bandwidth_gbps:g} GB/s):")
    print(simulate_cp.rank_table(rows, args.bandwidth_gbps))
    print("\nThe CP=N job (the slower of the two ranks):")
    print(simulate_cp.job_table(rows, args.bandwidth_gbps), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=None, help="20; with --simulate-cp: measured steps, 2")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--ac", default="every_layer", help="comma-separated: off, every_layer, every_n:K, selective")
    parser.add_argument("--loss", default="chunked", help="comma-separated: chunked, full")
    parser.add_argument("--loss-chunk-tokens", type=int, default=4096)
    parser.add_argument("--compile-backend", default=None)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="with --dry-run: the longest --seq-len whose estimate fits this (CUDA: the device's)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gdn-backend", default=None, choices=("triton", "eager"),
                        help="default: triton on cuda, eager on cpu (triton on cpu: TRITON_INTERPRET=1)")
    parser.add_argument("--small", action="store_true", help="a tiny model of the same shape family (smoke runs)")
    parser.add_argument("--gdn-checkpoint-around-core", action="store_true",
                        help="train.gdn_checkpoint_around_core (cp 1, eager layers: with --compile-backend eager on "
                             "cuda): less memory a token, one more forward of the GDN layers' projections, conv, "
                             "gated norm and out_proj")
    parser.add_argument("--profile", action="store_true",
                        help="profile the last step; print its kernels by device time (with --simulate-cp: one "
                             "step more per row, after the measured ones)")
    parser.add_argument("--verify", action="store_true",
                        help="train.verify: judge each step against unrewritten bf16 and float32 copies (parity)")
    parser.add_argument("--sdpa-backend", default=None, choices=tuple(SDPA_BACKENDS),
                        help="train.sdpa_backend: the one SDPA kernel of the attention CP does not rewrite")
    parser.add_argument("--pad-fraction", type=float, default=0.0,
                        help="right-pad each row's last fraction of tokens (mask 0, labels ignored); tokens/s counts "
                             "the real tokens")
    parser.add_argument("--offload-layer-inputs", action="store_true",
                        help="train.offload_layer_inputs: the checkpointed layers' inputs in host memory until their "
                             "backward")
    simulation = parser.add_argument_group("per-rank simulation of a CP=N job on one device (simulate_cp.py)")
    simulation.add_argument("--simulate-cp", default=None, help="comma-separated CP sizes N, e.g. 2,4,8,16")
    simulation.add_argument("--tokens", default=None, help="global tokens a step: 128K,256K,512K,1M (--small: 64,128)")
    simulation.add_argument("--sdpa", default="all_gather,ulysses",
                            help="comma-separated: all_gather, ulysses, head_tail (with GDN State-P2P in Head-Tail "
                                 "order)")
    simulation.add_argument("--warmup", type=int, default=2,
                            help="steps before the measured ones; the last counts the bytes sent (with 1: the first "
                                 "measured step does)")
    simulation.add_argument("--ranks", default="ends", choices=("ends", "first", "last", "middle", "ends+middle"),
                            help="the ranks each (N, tokens) runs: 0 and N-1, either alone, N//2, or all three")
    simulation.add_argument("--max-seconds", type=float, default=540.0, help="for all rows; rows past it say so")
    simulation.add_argument("--bandwidth-gbps", type=float, default=450.0, help="per direction (H200 NVLink: 450)")
    simulation.add_argument("--simulate-row", default=None, help=argparse.SUPPRESS)  # one row, in a child process
    args = parser.parse_args()
    if args.simulate_cp or args.simulate_row:
        return simulate(args, parser)
    args.steps = 20 if args.steps is None else args.steps

    import torch

    from cpcompile.trainer.parallelize import is_rank_zero

    single = int(os.environ.get("WORLD_SIZE", "1")) == 1
    rows = []
    for loss in args.loss.split(","):
        for ac in args.ac.split(","):
            try:
                rows.append(run_mode(args, loss, ac))
            except torch.OutOfMemoryError as exc:
                if not single:
                    raise
                print(f"loss {loss}, AC {ac}: out of memory ({str(exc).splitlines()[0]})", flush=True)
                rows.append({"loss": loss, "ac": ac, "note": "out of memory"})
            release_memory(args.device)
    if is_rank_zero():
        print(table(rows), flush=True)


if __name__ == "__main__":
    main()
