"""The trainer on GPU (issue 15 item 7): a Qwen3.5-shaped model of ~0.5B parameters, 32K tokens a
step, activation checkpointing + FSDP2 + CP, 20 steps; tokens/s, MFU and peak memory.

    python benchmarks/trainer_gpu.py                                   # one GPU, cp 1
    torchrun --nproc-per-node 2 benchmarks/trainer_gpu.py --cp 2       # two GPUs, cp 2
    options: --steps 20 --seq-len 32768 --ac every_layer|off --compile-backend inductor --dry-run
    python benchmarks/trainer_gpu.py --small --device cpu --steps 2     # a smoke run of the script on CPU

No network: the model is built from a config (random weights), the data are synthetic. Mixed
precision: float32 parameters, FSDP2 computing in bfloat16 and reducing in float32; GDN layers on
cpcompile's Triton core (with cp 1 too); SDPA AllGather and GDN State-P2P under CP. Every step
prints its peak allocated memory; the last line is the summary with MFU, counted as
6 x (non-embedding parameters) + the causal attention term per token, against `--peak-tflops`
(H200 dense bf16: 989), without the activation-checkpointing recompute.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = dict(model_type="qwen3_5_text", vocab_size=151936, hidden_size=1024, intermediate_size=3584,
             num_hidden_layers=20, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
             linear_num_value_heads=16, linear_conv_kernel_dim=4, tie_word_embeddings=True)


SMALL = dict(MODEL, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


def config(args) -> dict:
    backend = "triton" if args.device == "cuda" else "eager"
    plan = {"accelerator": {"cp_size": args.cp}, "plan_overrides": [
        {"match": "*.linear_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
         "inner_wrapper": {"_target_": "cpcompile.adapters.qwen3_5.qwen3_5_gdn_p2p_cp_wrapper", "backend": backend}},
        {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
         "inner_wrapper": "sdpa_hf"}]}
    return {"model": SMALL if args.small else MODEL, **plan,
            "train": {"steps": args.steps, "seq_len": args.seq_len, "batch_size": 1, "lr": 3e-4, "seed": 0,
                      "dtype": "float32", "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                      "grad_clip": 1.0, "activation_checkpointing": args.ac, "gdn_backend": backend,
                      "compile_backend": args.compile_backend, "device": args.device},
            "optimizer": {"warmup_steps": 2}}


def flops_per_token(model, seq_len: int) -> float:
    """6 x non-embedding parameters + causal attention (QK^T and PV: 6 x 2 x S/2 x heads x head_dim
    per attention layer, forward + backward)."""
    text = model.config.get_text_config()
    embedding = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" in name or "lm_head" in name)
    dense = sum(p.numel() for p in model.parameters()) - embedding
    attention_layers = sum(1 for kind in text.layer_types if kind == "full_attention")
    return 6 * dense + 6 * attention_layers * seq_len * text.num_attention_heads * text.head_dim


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--ac", default="every_layer", choices=("off", "every_layer"))
    parser.add_argument("--compile-backend", default=None)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="a tiny model of the same shape family (smoke runs)")
    args = parser.parse_args()

    import torch

    from cpcompile.trainer import dry_run, load_train_config
    from cpcompile.trainer.loop import build_trainer, memory_estimate
    from cpcompile.trainer.metrics import format_step, summary
    from cpcompile.trainer.parallelize import is_rank_zero

    train_config = load_train_config(config(args))
    if args.dry_run:
        dry_run(train_config)
        return
    trainer = build_trainer(train_config)
    per_token = flops_per_token(trainer.model, args.seq_len)
    if is_rank_zero():
        params = sum(p.numel() for p in trainer.model.parameters())
        estimate = memory_estimate(train_config, params, trainer.model.config)
        print(f"{params / 1e6:.1f} M parameters, {args.seq_len} tokens/step, cp {args.cp}, AC {args.ac}, "
              f"{per_token / 1e9:.2f} GFLOP/token; memory estimate per rank "
              + ", ".join(f"{k} {v:.3g} GiB" for k, v in estimate.items()), flush=True)
    records = []
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for index in range(args.steps):
        records.append(trainer.step(index))
        if is_rank_zero():
            print(format_step(records[-1], args.steps), flush=True)
    if is_rank_zero():
        print(summary(records, args.seq_len, per_token, args.peak_tflops * 1e12 * args.cp), flush=True)


if __name__ == "__main__":
    main()
