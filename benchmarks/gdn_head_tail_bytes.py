"""Bytes a rank sends for GDN in Head-Tail order, per mechanism, and for the alternative (issue 49).

    python benchmarks/gdn_head_tail_bytes.py [--cp 8,16] [--tokens 512K,1M] [--triton]

Part 1, counted: one Qwen3.5 GDN layer at `trainer_gpu.py`'s model shapes (hidden 1024, 16 key /
16 value heads of 128, conv kernel 4; bf16, as FSDP2 computes) compiled under each GDN method and
run forward and backward on rank 0, a middle rank and the last rank of a fake CP=N group (PyTorch's
fake process group: nothing moves, `collective_bytes.CollectiveBytes` counts what each rank sends).
A layer's bytes do not depend on the sequence length but for the conv halo (3 tokens a fragment),
so 8 local tokens stand for any. `--triton` adds the triton Head-Tail relay (the executor's
point-to-point sends), in Triton's CPU interpreter (`TRITON_INTERPRET=1`; slow at head dim 128).

Part 2, from those counts: the bytes per training step and rank of the 0.57B model (15 GDN + 5
SDPA layers), forward + backward without activation-checkpointing recompute, for
- GDN in Head-Tail order beside SDPA Head-Tail (the relay, or the summaries all-gathered), and
- the alternative: GDN contiguous (State-P2P) and SDPA Head-Tail, the hidden states converted from
  contiguous to Head-Tail order before each attention layer and back after it (one all-to-all each
  way, forward; the same two in the backward), whose bytes are counted from the permutation
  (`conversion_bytes`: the tokens of a rank's contiguous block that another rank holds in Head-Tail
  order), and
- a log-depth scan of the summaries (not built): ceil(log2(2N)) rounds of both fragments' (M, S).
The SDPA layers' K/V all-gather is the same in every row (Head-Tail gathers what AllGather gathers).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GDN_LAYERS, SDPA_LAYERS, HIDDEN, BF16 = 15, 5, 1024, 2
LAYER = dict(hidden_size=HIDDEN, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
             linear_num_value_heads=16, linear_conv_kernel_dim=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=256, vocab_size=512, intermediate_size=256, num_hidden_layers=4)
LOCAL_TOKENS = 8
METHODS = ("p2p", "p2p_head_tail", "all_gather_head_tail")


def _holder_class():
    import torch

    class Holder(torch.nn.Module):
        """One GDN layer as a model, so `compile` can target `layer`."""

        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, hidden):
            return self.layer(hidden)

    return Holder


def count_layer(method: str, cp: int, rank: int, backend: str = "eager") -> int:
    """Bytes rank `rank` of a fake CP=`cp` group sends for one GDN layer, forward + backward."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    import cpcompile
    from collective_bytes import CollectiveBytes

    Holder = _holder_class()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        torch.manual_seed(0)
        holder = Holder(Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**LAYER), layer_idx=0).to(torch.bfloat16))
        wrapper = {"_target_": f"cpcompile.adapters.qwen3_5.qwen3_5_gdn_{method}_cp_wrapper", "backend": backend}
        plan = cpcompile.load_plan({"accelerator": {"cp_size": cp}, "plan_overrides": [
            {"match": "layer", "when": "cp", "region_dispatch": False, "inner_target": "self",
             "inner_wrapper": wrapper}]})
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
        hidden = torch.randn(1, LOCAL_TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        model = cpcompile.compile(holder, mesh, plan, example_inputs=(hidden,))
        model(hidden).float().sum().backward()  # the first call: anything once-only happens here
        with CollectiveBytes() as sent:
            model(hidden).float().sum().backward()
        return sent.total
    finally:
        dist.destroy_process_group()


def conversion_bytes(tokens: int, cp: int, rank: int) -> int:
    """Bytes rank `rank` sends converting `[tokens / cp, HIDDEN]` bf16 hidden states from contiguous to
    Head-Tail order (the way back sends as many): its contiguous block is chunks 2r and 2r+1 of 2N;
    a chunk stays only where its Head-Tail owner is `rank`."""
    chunk = tokens // (2 * cp)
    owner = lambda j: j if j < cp else 2 * cp - 1 - j  # noqa: E731
    moved = sum(1 for j in (2 * rank, 2 * rank + 1) if owner(j) != rank)
    return moved * chunk * HIDDEN * BF16


STATE = 16 * 128 * 128 * 4  # one fp32 state [Hv, K, V]
HALO = 2 * 2 * 3 * (2 * 16 * 128 + 16 * 128) * BF16  # fwd + bwd, two fragments of 3 tokens of the conv input


def summary_bytes() -> int:
    """One fragment's (M, S), fp32: 16 heads x (128x128 + 128x128)."""
    return 16 * (128 * 128 + 128 * 128) * 4


def main() -> None:
    from simulate_cp import parse_tokens, short_tokens

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", default="8,16")
    parser.add_argument("--tokens", default="512K,1M")
    parser.add_argument("--triton", action="store_true", help="also the triton relay (TRITON_INTERPRET=1: slow)")
    args = parser.parse_args()
    sizes, token_counts = [int(x) for x in args.cp.split(",")], parse_tokens(args.tokens)
    methods = [(m, "eager") for m in METHODS]
    if args.triton:
        methods += [("p2p", "triton"), ("p2p_head_tail", "triton")]
    counted = {}
    print("| GDN method (backend) | N | rank | bytes sent per GDN layer, fwd + bwd |\n|---|---|---|---|")
    for cp in sizes:
        for method, backend in methods:
            for rank in sorted({0, cp // 2, cp - 1}):
                counted[method, backend, cp, rank] = count_layer(method, cp, rank, backend)
                print(f"| {method} ({backend}) | {cp} | {rank} | {counted[method, backend, cp, rank]:,} |", flush=True)
    print("\nPer training step and rank, MB (forward + backward, no AC recompute), the most any rank sends:\n")
    print("| N | tokens | HT relay, triton (point to point) | HT relay, eager (collective steps) | HT all-gather | "
          "HT log-depth scan (est.) | alternative: GDN contiguous (triton State-P2P) + 2 all-to-alls an "
          "attention layer |\n"
          "|---|---|---|---|---|---|---|")
    for cp in sizes:
        worst = lambda m, b: max(counted[m, b, cp, r] for r in {0, cp // 2, cp - 1})  # noqa: E731
        if args.triton:
            relay, contiguous = worst("p2p_head_tail", "triton"), worst("p2p", "triton")
        else:  # the executors send each state once a direction: two a fragment (forward, backward)
            relay, contiguous = HALO + 2 * 2 * STATE, HALO // 2 + 2 * STATE
        scan = GDN_LAYERS * (HALO + 2 * math.ceil(math.log2(2 * cp)) * 2 * summary_bytes())
        for tokens in token_counts:
            convert = max(4 * conversion_bytes(tokens, cp, r) for r in range(cp))
            alternative = GDN_LAYERS * contiguous + SDPA_LAYERS * convert
            source = "" if args.triton else " (formula)"
            print(f"| {cp} | {short_tokens(tokens)} | {GDN_LAYERS * relay / 1e6:.1f}{source} | "
                  f"{GDN_LAYERS * worst('p2p_head_tail', 'eager') / 1e6:.1f} | "
                  f"{GDN_LAYERS * worst('all_gather_head_tail', 'eager') / 1e6:.1f} | {scan / 1e6:.1f} | "
                  f"{alternative / 1e6:.1f}{source} |")


if __name__ == "__main__":
    main()
