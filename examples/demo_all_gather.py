"""AllGather context parallelism on a tiny Hugging Face Qwen3, checked against one device.

Run with `bash scripts/demo.sh` (4 CPU processes under torchrun). Every rank builds the same
randomly initialised model, runs the CP=1 reference on the whole batch, then compiles a
copy with an AllGather plan at CP=4, runs its local shard forward and backward, and rank 0
prints logits, loss and gradients side by side. The run holds a tolerance (`--rtol`, 1e-5
relative in fp32): each rank exits with status 1 when the logits (real tokens), the loss or any
parameter's gradient differ by more, and rank 0 says so in one line starting with `FAIL:`.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

import cpcompile
from cpcompile.dump import resolve_dump_dir

PLAN = """
accelerator:
  cp_size: {cp}
plan_overrides:
  - match: "*.self_attn"
    when: cp
    region_dispatch: false
    inner_target: self
    inner_wrapper:
      _target_: cpcompile.wrappers.sdpa_hf_cp_wrapper
"""


def build_model(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config)


def global_batch(length: int) -> dict:
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 512, (2, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, : length // 5] = 0  # left padding on the second row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def grad_norm(model: torch.nn.Module) -> float:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def worst_gradient(model: torch.nn.Module, reference: torch.nn.Module) -> tuple[float, str]:
    """The largest relative gradient error over all parameters, and that parameter's name."""
    pairs = zip(model.named_parameters(), reference.parameters())
    return max((rel_error(p.grad, q.grad), name) for (name, p), q in pairs)


def shown(path: str) -> str:
    """`path` as the user can type it: relative to the working directory when under it."""
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else os.path.abspath(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dump-dir", default="cp_dump")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of logits, loss and gradients")
    args = parser.parse_args()
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    os.makedirs(args.dump_dir, exist_ok=True)
    plan_path = os.path.join(args.dump_dir, "plan.yaml")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(plan_path, "w") as f:  # the plan as a user would write it
            f.write(PLAN.format(cp=cp))
    dist.init_process_group("gloo")
    dist.barrier()
    plan = cpcompile.load_plan(plan_path)
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    batch = global_batch(args.seq_len)

    reference = build_model(seed=0)
    ref_out = reference(**batch, use_cache=False)
    ref_out.loss.backward()

    model = build_model(seed=0)
    local = cpcompile.shard_batch(batch, mesh, plan)
    cpcompile.compile(model, mesh, plan, dump_dir=args.dump_dir, example_inputs=local)  # each rank: <dump_dir>/rank<r>
    rank_dump = str(resolve_dump_dir(args.dump_dir))  # this rank's folder, as compile chose it
    out = model(**local)
    out.loss.backward()
    cpcompile.all_reduce_gradients(model, mesh)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=mesh.cp_group)
    logits = cpcompile.unshard(out.logits.detach(), mesh, plan)  # every rank: the whole sequence

    real = batch["attention_mask"].bool()  # padded positions' logits are not defined at CP=1 either
    worst, worst_name = worst_gradient(model, reference)
    checks = [  # (what, relative error); the same numbers on every rank, so every rank agrees
        ("logits", rel_error(logits[real], ref_out.logits.detach()[real])),
        ("loss", rel_error(loss, ref_out.loss.detach())),
        (f"gradient of {worst_name}", worst),
    ]
    failed = [(what, err) for what, err in checks if not err <= args.rtol]  # `not <=`: NaN fails
    if mesh.cp_rank == 0:
        rows = [
            ("loss", ref_out.loss.item(), loss.item()),
            ("grad norm", grad_norm(reference), grad_norm(model)),
        ]
        print(f"\nAllGather CP={cp} vs CP=1 — tiny Qwen3, batch 2 x {args.seq_len} tokens (padded), fp32, gloo")
        print(f"{'':<12}{'CP=1':>14}{f'CP={cp}':>14}{'rel. error':>14}")
        for name, a, b in rows:
            print(f"{name:<12}{a:>14.6f}{b:>14.6f}{abs(a - b) / abs(a):>14.2e}")
        print(f"{'logits':<12}{'':>28}{checks[0][1]:>14.2e}   (real tokens)")
        print(f"{'worst param':<12}{'':>28}{worst:>14.2e}   (max over all parameter gradients: {worst_name})")
        print(f"\ngraph dump: {shown(rank_dump)} (one folder per rank)")
        print(f"inspect it: {shown(sys.executable)} -m cpcompile inspect {shown(rank_dump)}")
        if failed:
            print("FAIL: " + "; ".join(f"{what} rel. error {err:.2e} > {args.rtol:.0e}" for what, err in failed),
                  file=sys.stderr, flush=True)
        else:
            print(f"PASS: logits, loss and every gradient within {args.rtol:.0e} relative of CP=1")
    cpcompile.release_process_group()  # every rank done with its collectives before the group goes
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
