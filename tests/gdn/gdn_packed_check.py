"""Packed documents through every GDN method (eager backend) on real devices: run under torchrun,
one process per CP rank (`--device cuda` uses NCCL). The tiny Qwen3.5 of the CPU tests, with its
three GDN layers on State-P2P, Ulysses and State-AllGather, in fp32 on a packed row, against the
unrewritten model on each document alone; prints the errors and exits 1 when one misses the CPU
tests' bounds (logits, loss, gradients <= 1e-5; the decay parameters' as close to a float64 run as
the fp32 reference is, `gdn_harness.decay_vs_truth`).

    torchrun --standalone --nproc-per-node 2 tests/gdn/gdn_packed_check.py --device cuda
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpcompile  # noqa: E402
from cp_harness import rel  # noqa: E402
from gdn_harness import (  # noqa: E402
    DECAY_PARAMS, decay_as_close_as_reference, decay_vs_truth, tiny_qwen3_5, use_reference_gdn,
)
from test_gdn_packed import each_document_alone, mixed_plan, packed_batch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    try:
        batch, spans = packed_batch(args.seed, world)
        batch = {k: v.to(args.device) for k, v in batch.items()}  # moved before sharding: the mark stays
        want = each_document_alone(use_reference_gdn(tiny_qwen3_5(args.seed).to(args.device)), batch, spans)
        truth = each_document_alone(use_reference_gdn(tiny_qwen3_5(args.seed, torch.float64).to(args.device)), batch,
                                    spans)
        plan = cpcompile.load_plan(mixed_plan(world))
        mesh = cpcompile.build_mesh(plan.accelerator, device_type=args.device)
        local = cpcompile.shard_batch(batch, mesh, plan)
        model = cpcompile.compile(tiny_qwen3_5(args.seed).to(args.device), mesh, plan, example_inputs=local)
        out = model(**local)
        out.loss.backward()
        cpcompile.all_reduce_gradients(model, mesh)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=mesh.cp_group)
        grads = {n: rel(p.grad, want["grads"][n]) for n, p in model.named_parameters() if n in want["grads"]}
        rest = max(v for n, v in grads.items() if not n.endswith(DECAY_PARAMS))
        decay = decay_vs_truth({n: p.grad for n, p in model.named_parameters()}, want["grads"], truth["grads"])
        worst = max(decay.values(), key=lambda pair: pair[0] - 10 * pair[1])  # CP vs float64, reference vs float64
        errors = {"logits": rel(cpcompile.unshard(out.logits.detach(), mesh, plan), want["logits"]),
                  "loss": rel(loss, want["loss"]), "grads": rest, "decay_grads_vs_float64": worst[0],
                  "reference_decay_vs_float64": worst[1]}
        ok = max(errors["logits"], errors["loss"], rest) <= 1e-5 and decay_as_close_as_reference(decay)
        if dist.get_rank() == 0:
            print(f"packed GDN, {world} ranks on {args.device}:", {k: f"{v:.2e}" for k, v in errors.items()},
                  "PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
