"""Overhead of the rewrite itself: AllGather forced onto a 1-rank cp group vs the original module.

With one rank the collectives move nothing, so any difference is what the rewritten graph
adds (the extra permutes/copies around the gathers, the explicit mask, the graph call).
One process, gloo, CPU. Prints a table; forward+backward of one Qwen3 attention module.

    python benchmarks/rewrite_overhead.py [--seq-len 2048] [--repeat 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

import cpcompile
from cpcompile.installed_region import InstalledRegion, Target
from cpcompile.plan import Override


def attention_and_inputs(seq_len: int, batch: int, padded: bool):
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                         attn_implementation="sdpa")
    module = Qwen3Attention(config, layer_idx=0)
    hidden = torch.randn(batch, seq_len, config.hidden_size, requires_grad=True)
    positions = torch.arange(seq_len).unsqueeze(0)
    cos, sin = Qwen3RotaryEmbedding(config)(hidden, positions)
    mask = None
    if padded:  # HF's local mask: causal and key-valid (left padding on row 0)
        valid = torch.ones(batch, seq_len, dtype=torch.bool)
        valid[0, : seq_len // 8] = False
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    return module, (hidden,), {"position_embeddings": (cos, sin), "attention_mask": mask}


def fwd_bwd_seconds(fn, args, kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)[0].sum().backward()
    return time.perf_counter() - start


def median_ms(fns, args, kwargs, warmup: int, repeat: int) -> list[float]:
    """Median fwd+bwd time of each fn; runs are interleaved so load drifts hit all alike."""
    times = [[] for _ in fns]
    for i in range(warmup + repeat):
        for fn, bucket in zip(fns, times):
            elapsed = fwd_bwd_seconds(fn, args, kwargs)
            if i >= warmup:
                bucket.append(elapsed)
    return [statistics.median(t) * 1e3 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = cpcompile.build_mesh(cpcompile.AcceleratorConfig(cp_size=1), device_type="cpu")
    method = cpcompile.load_plan({"plan_overrides": [{"match": "x", "when": "cp", "region_dispatch": False,
                                                       "inner_wrapper": "sdpa_hf"}]}).overrides[0].method
    print(f"threads={torch.get_num_threads()} warmup={args.warmup} repeat={args.repeat} (median ms, fwd+bwd)")
    print(f"{'case':<26}{'shape (B,S,H,Hkv,D)':<24}{'original':>10}{'rewritten':>11}{'ratio':>8}")
    for batch, padded in ((1, False), (2, True)):
        module, call_args, call_kwargs = attention_and_inputs(args.seq_len, batch, padded)
        override = Override(match="attn", when="cp", region_dispatch=False, method=method)
        region = InstalledRegion(Target("attn", module, override), mesh, None, call_args, call_kwargs)
        original, rewritten = median_ms([module.forward, region], call_args, call_kwargs, args.warmup, args.repeat)
        case = "is_causal, no mask" if not padded else "padding mask"
        shape = f"({batch},{args.seq_len},16,4,64)"
        print(f"{case:<26}{shape:<24}{original:>10.2f}{rewritten:>11.2f}{rewritten / original:>8.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
