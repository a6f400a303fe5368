"""A custom attention made context-parallel with `local_compute_fn` and cpcompile's CP primitives.

`HandAttention` is not SDPA: softmax(QKᵀ/√d + causal mask)·V written out (so cpcompile's SDPA
rewrite cannot serve it). Two registered local compute functions make it CP-correct:

- `cp_hand_attention`: AllGather — K and V gathered along the sequence
  (`all_gather_sequence`, backward reduce-scatter), the causal mask shifted to this rank's
  global query offset (`query_offset`);
- `cp_hand_attention_ulysses`: Ulysses — Q, K, V exchanged sequence→heads, full-sequence
  attention on this rank's heads, the output exchanged back.

Run: `torchrun --nproc-per-node 2 examples/custom_local_compute.py [--ulysses]`; every rank
checks the CP output and gradients against the single-process model and exits 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn

import cpcompile
from cpcompile.primitives import all_gather_sequence, heads_to_sequence, query_offset, sequence_to_heads


class HandAttention(nn.Module):
    """Causal attention over `[B, H, S, D]` q, k, v, written by hand."""

    def forward(self, q, k, v):
        return self.attend(q, k, v, first_query=0)

    @staticmethod
    def attend(q, k, v, first_query: int):
        """Queries at global positions first_query, first_query+1, ... against keys 0, 1, ..."""
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        query_pos = torch.arange(q.shape[2], device=q.device) + first_query
        key_pos = torch.arange(k.shape[2], device=q.device)
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        return scores.softmax(dim=-1) @ v


@cpcompile.local_compute_fn
def cp_hand_attention(module, q, k, v, *, cp):
    keys, values = all_gather_sequence(k, cp, seq_dim=2), all_gather_sequence(v, cp, seq_dim=2)
    return module.attend(q, keys, values, first_query=query_offset(q.shape[2], cp))


@cpcompile.local_compute_fn
def cp_hand_attention_ulysses(module, q, k, v, *, cp):
    q, k, v = (sequence_to_heads(t, cp) for t in (q, k, v))
    return heads_to_sequence(module.attend(q, k, v, first_query=0), cp)


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.core = HandAttention()
        self.out = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return x + self.out(self.core(q, k, v).transpose(1, 2).reshape(batch, length, width))


class TinyModel(nn.Module):
    def __init__(self, width: int = 16, heads: int = 4, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def plan(cp_size: int, fn) -> dict:
    return {"accelerator": {"cp_size": cp_size}, "plan_overrides": [
        {"match": "blocks.*.core", "when": "cp", "region_dispatch": False, "local_compute_fn": fn}]}


def compare(fn, seed: int = 0, batch: int = 2, length: int = 8, width: int = 16, dump_dir=None) -> dict:
    """On this rank: the single-process model on the whole batch, and a CP copy on this rank's
    slice; relative errors of the output (gathered) and every gradient (summed over cp)."""
    torch.manual_seed(seed)
    reference = TinyModel(width)
    model = TinyModel(width)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(batch, length, width, generator=torch.Generator().manual_seed(seed + 1))
    reference(x).square().sum().backward()
    want = reference(x).detach()

    cp_plan = cpcompile.load_plan(plan(dist.get_world_size(), fn))
    mesh = cpcompile.build_mesh(cp_plan.accelerator, device_type="cpu")
    local = x.chunk(mesh.cp_size, dim=1)[mesh.cp_rank].contiguous()
    cpcompile.compile(model, mesh, cp_plan, example_inputs=(local,), dump_dir=dump_dir)
    out = model(local)
    out.square().sum().backward()
    cpcompile.all_reduce_gradients(model, mesh)
    got = cpcompile.unshard(out.detach(), mesh, cp_plan)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    grads = {n: rel(p.grad, dict(reference.named_parameters())[n].grad) for n, p in model.named_parameters()}
    return {"output": rel(got, want), "grads": grads,
            "installed": all(hasattr(b.core, "_cpcompile_config") for b in model.blocks)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ulysses", action="store_true", help="the Ulysses local compute instead of AllGather")
    parser.add_argument("--rtol", type=float, default=1e-5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    result = compare(cp_hand_attention_ulysses if args.ulysses else cp_hand_attention)
    worst = max(result["grads"].values())
    ok = result["output"] <= args.rtol and worst <= args.rtol
    if dist.get_rank() == 0:
        print(f"output rel err {result['output']:.2e}, worst gradient rel err {worst:.2e}: {'ok' if ok else 'FAIL'}")
    cpcompile.release_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
