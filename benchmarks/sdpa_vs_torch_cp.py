"""SDPA context parallelism against what a user would otherwise pick, in one launch.

    torchrun --standalone --nproc-per-node 2 benchmarks/sdpa_vs_torch_cp.py --device cuda \
        [--seq 8192 32768 131072] [--heads mha gqa] [--methods ...] [--warmup 2] [--repeat 5] [--out FILE]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/sdpa_vs_torch_cp.py --device cpu \
        --size tiny --seq 256 --warmup 0 --repeat 1          # the CPU/gloo smoke run (CI runs it)

Rows, for each global sequence length and head layout of a Qwen3-shaped model (4 layers, hidden
1024; "mha": 16 heads of 64; "gqa": 16 query / 4 KV heads of 128), bf16 on CUDA:
- `no CP (1 device)`: the model on the whole sequence on rank 0 alone (the others wait);
- `torch context_parallel`: PyTorch's own CP (ring attention, its head-tail load balancer), the
  unrewritten model inside `context_parallel(...)` with ids, labels and position ids as buffers;
- every cpcompile SDPA method the world size allows, on `shard_batch`'s local slice.
Forward (to the loss) and backward are timed separately: median of `repeat` steps after `warmup`,
max over ranks; peak allocated memory of the measured steps, max over ranks. `loss` is the global
mean loss of the first step (a sanity column: every row sees the same tokens). A row that runs out
of memory says so and the run goes on.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import contextlib
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cpcompile  # noqa: E402
from cpcompile.bench import time_steps  # noqa: E402

VOCAB = 4096
HEADS = {  # (query heads, KV heads, head dim) at hidden 1024
    "mha": (16, 16, 64),
    "gqa": (16, 4, 128),
}
SIZES = {"small": (1024, 4), "tiny": (64, 2)}  # (hidden, layers); tiny divides the heads' widths by 16
METHODS = {
    "all_gather": "sdpa_hf_cp_wrapper", "ulysses": "sdpa_hf_ulysses_cp_wrapper",
    "head_tail": "sdpa_hf_load_balance_cp_wrapper", "hybrid": "sdpa_hf_hybrid_cp_wrapper",
    "async_all_gather": "sdpa_hf_async_cp_wrapper", "async_ulysses": "sdpa_hf_async_ulysses_cp_wrapper",
    "async_hybrid": "sdpa_hf_async_hybrid_cp_wrapper",
}


def build(args, heads: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, layers = SIZES[args.size]
    q_heads, kv_heads, head_dim = head_layout(args, heads)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(args.device, args.dtype)


def head_layout(args, heads: str) -> tuple[int, int, int]:
    q_heads, kv_heads, head_dim = HEADS[heads]
    if args.size == "tiny":
        return q_heads // 4, max(kv_heads // 4, 1), head_dim // 16
    return q_heads, kv_heads, head_dim


def global_batch(seq: int, device: str) -> dict:
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def plan_for(method: str, world: int) -> dict:
    wrapper = {"_target_": f"cpcompile.wrappers.{METHODS[method]}"}
    if "hybrid" in method:
        wrapper["ulysses_degree"] = 2
    return {"accelerator": {"cp_size": world},
            "plan_overrides": [{"match": "*.self_attn", "when": "cp", "region_dispatch": False,
                                "inner_target": "self", "inner_wrapper": wrapper}]}


def skip_reason(method: str, world: int) -> str | None:
    if "hybrid" in method and (world < 4 or world % 2):
        return "Hybrid (ulysses_degree 2) needs an even CP size >= 4"
    return None


def cpcompile_step(method: str, args, heads: str, batch: dict):
    plan = cpcompile.load_plan(plan_for(method, dist.get_world_size()))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type=args.device)
    local = cpcompile.shard_batch(batch, mesh, plan)
    model = cpcompile.compile(build(args, heads), mesh, plan, example_inputs=local)

    def step():
        model.zero_grad(set_to_none=True)
        return model(**local).loss

    return step, _summed, contextlib.nullcontext


def torch_cp_step(args, heads: str, batch: dict):
    """PyTorch's CP: buffers are sharded in place when the context opens, so each step opens it on
    fresh copies of the global ones; forward and backward run inside it, as torchtitan does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("cp",))
    model = build(args, heads)
    seq = batch["input_ids"].shape[1]
    shifted = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)
    full = {"input_ids": batch["input_ids"], "labels": shifted, "shift_labels": shifted,
            "position_ids": torch.arange(seq, device=args.device)[None],
            # an all-ones padding mask keeps transformers from reading the load balancer's position-id
            # jumps as packed documents (it would build a quadratic local mask)
            "attention_mask": torch.ones(1, seq, dtype=torch.long, device=args.device)}
    buffers: dict = {}

    def context():
        buffers.update({k: v.clone() for k, v in full.items()})
        return context_parallel(mesh, buffers=list(buffers.values()), buffer_seq_dims=[1] * len(buffers))

    def step():
        model.zero_grad(set_to_none=True)
        return model(**buffers, use_cache=False).loss

    return step, _averaged, context


def single_device_step(args, heads: str, batch: dict):
    model = build(args, heads) if dist.get_rank() == 0 else None

    def step():
        if model is None:
            return torch.zeros((), device=args.device, requires_grad=True)
        model.zero_grad(set_to_none=True)
        return model(**batch, use_cache=False).loss

    return step, _from_rank0, contextlib.nullcontext


def _summed(loss):
    value = loss.detach().float().clone()
    dist.all_reduce(value)
    return value.item()


def _averaged(loss):
    return _summed(loss) / dist.get_world_size()


def _from_rank0(loss):
    value = loss.detach().float().clone()
    dist.broadcast(value, 0)
    return value.item()


def measure(make, args, heads, seq) -> dict:
    batch = global_batch(seq, args.device)
    try:
        step, global_loss, context = make(args, heads, batch)
        with context():
            first = global_loss(step())
        stats = time_steps(step, args.warmup, args.repeat, args.device, context=context)
        return {"loss": first, **stats}
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is a row, not the end of the run
        if make is not torch_cp_step:
            raise
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    finally:
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def rows_for(args, heads: str, seq: int):
    world = dist.get_world_size()
    yield "no CP (1 device)", seq, measure(single_device_step, args, heads, seq)
    if args.torch_cp:
        yield "torch context_parallel", seq // world, measure(torch_cp_step, args, heads, seq)
    for method in args.methods:
        reason = skip_reason(method, world)
        if reason:
            yield f"cpcompile {method}", seq // world, {"error": f"skipped: {reason}"}
            continue
        yield (f"cpcompile {method}", seq // world,
               measure(lambda a, h, b, m=method: cpcompile_step(m, a, h, b), args, heads, seq))


def format_row(name, heads, seq, tokens, r, args) -> str:
    q_heads, kv_heads, head_dim = head_layout(args, heads)
    shape = f"{heads} {q_heads}/{kv_heads}x{head_dim}, S={seq}"
    if "error" in r:
        return f"| {name} | {shape} | {tokens} | {args.warmup}/{args.repeat} | {r['error']} | | | |"
    return (f"| {name} | {shape} | {tokens} | {args.warmup}/{args.repeat} | {r['fwd']:.2f} | {r['bwd']:.2f} "
            f"| {r['alloc']:.2f} | {r['loss']:.4f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--heads", nargs="+", choices=sorted(HEADS), default=["mha", "gqa"])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS),
                        default=["all_gather", "ulysses", "head_tail", "hybrid", "async_all_gather", "async_ulysses"])
    parser.add_argument("--no-torch-cp", dest="torch_cp", action="store_false",
                        help="skip PyTorch's context_parallel (it needs a device mesh of the device type)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    lines = [f"# SDPA CP against PyTorch's context_parallel — {_dt.date.today().isoformat()}", "",
             f"Device: {dist.get_world_size()} x {device}, backend {dist.get_backend()}, torch {torch.__version__}, "
             f"{args.dtype}, model '{args.size}' ({SIZES[args.size][1]} layers, hidden {SIZES[args.size][0]}), "
             f"vocab {VOCAB}, batch 1. Times: median ms, max over ranks. Produced by "
             "`benchmarks/sdpa_vs_torch_cp.py`.", "",
             "| variant | shapes | tokens per rank | warmup/repeat | fwd ms | bwd ms | peak alloc GiB | loss |",
             "|---|---|---|---|---|---|---|---|"]
    try:
        for heads in args.heads:
            for seq in args.seq:
                for name, tokens, result in rows_for(args, heads, seq):
                    lines.append(format_row(name, heads, seq, tokens, result, args))
                    if dist.get_rank() == 0:
                        print(lines[-1], flush=True)
                        if args.out:
                            Path(args.out).write_text("\n".join(lines) + "\n")
        if dist.get_rank() == 0:
            print("\n".join(lines))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
