"""The local attention a CP rank runs after its collectives, against one fused call on the same work.

    python benchmarks/local_attention.py [--seq 32768 131072] [--cp 2] [--out FILE]     (CUDA, bf16)

For each global length S, head layout (MHA 16x64, GQA 16/4x128) and rank layout at CP=P:
- AllGather, last rank: S/P queries at (P-1)·S/P against the S keys before and with them;
- Head-Tail, rank 0: chunks 0 and 2P-1 of S/(2P) queries against their key prefixes;
rows: `local_attention` with each CUDA kernel (unmasked prefix block + is_causal diagonal block per
chunk, merged by log-sum-exp), the same with one padded key (FlexAttention with its block mask),
optionally packed rows of documents (`--documents`, FlexAttention skipping cross-document blocks; for
Head-Tail also the rank-0 share of the same row cut per document, the layout `shard_batch` gives a
packed batch: FlexAttention with queries at the batch's positions), and the
reference: one flash call per chunk with `is_causal` against its key prefix, which FlashAttention-2
aligns to the bottom right (what no SDPA API spells for a rank). Forward and forward+backward:
median ms (triton.testing.do_bench); peak memory of one forward+backward above the inputs.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpcompile.documents import per_document_head_tail, positions_from_starts  # noqa: E402
from cpcompile.kernels.attention import local_attention  # noqa: E402

aten = torch.ops.aten
HEADS = {"mha": (16, 16, 64), "gqa": (16, 4, 128)}


def layouts(seq: int, cp: int) -> dict[str, list[int]]:
    local, chunk = seq // cp, seq // (2 * cp)
    return {"all_gather (last rank)": [(cp - 1) * local], "head_tail (rank 0)": [0, (2 * cp - 1) * chunk]}


def inputs(heads: str, rows: int, keys: int):
    hq, hkv, d = HEADS[heads]
    make = lambda h, s: torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    return make(hq, rows), make(hkv, keys), make(hkv, keys)


def packed_tags(keys: int, mean_document: int) -> torch.Tensor:
    """Key tags of one packed row: documents of random lengths around `mean_document` tokens."""
    gen = torch.Generator().manual_seed(0)
    starts = torch.rand(keys, generator=gen) < 1 / mean_document
    starts[0] = False
    return starts.long().cumsum(0)[None].cuda()


def rank_zero_per_document(tags: torch.Tensor, cp: int) -> torch.Tensor:
    """`[1, S/cp]`: the global positions rank 0 holds when the packed row of `tags` is cut per
    document (`cpcompile.documents.per_document_head_tail`)."""
    docs = tags[0].cpu()
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[1:] = docs[1:] != docs[:-1]
    order = per_document_head_tail(positions_from_starts(starts)[None], cp)[0]
    return order[: docs.numel() // cp][None].cuda()


def ours(kernel: str, starts: list[int], tags: torch.Tensor | None = None, query_positions=None):
    """local_attention; `tags` None is one unpadded document (the unmasked blocks)."""
    def run(q, k, v):
        key_tags = tags if tags is not None else torch.zeros(1, k.shape[2], dtype=torch.long, device="cuda")
        return local_attention(q, k, v, key_tags, starts, True, q.shape[-1] ** -0.5, kernel, "flex", query_positions)
    return run


def flash_per_chunk(starts: list[int]):
    def run(q, k, v):
        c = q.shape[2] // len(starts)
        outs = [aten._scaled_dot_product_flash_attention(q[:, :, i * c:(i + 1) * c], k[:, :, :s + c], v[:, :, :s + c],
                                                         0.0, True, False)[0] for i, s in enumerate(starts)]
        return torch.cat(outs, dim=2)
    return run


def measure(fn, q, k, v) -> tuple[float, float, float]:
    from triton.testing import do_bench

    grad = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    fwd = do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
    both = do_bench(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad), warmup=25, rep=100,
                    return_mode="median")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(fn(q, k, v), (q, k, v), grad)
    torch.cuda.synchronize()
    return fwd, both, (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--kernels", nargs="+", default=["flash", "cudnn"])
    parser.add_argument("--documents", type=int, nargs="*", default=[],
                        help="also packed rows with documents of about these many tokens (FlexAttention)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [f"# Local attention per rank — {_dt.date.today().isoformat()}, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, bf16, CP={args.cp}", "",
             "| rank layout | heads | S | variant | fwd ms | fwd+bwd ms | peak GiB above inputs |", "|---|---|---|---|---|---|---|"]
    for seq in args.seq:
        for heads in HEADS:
            for name, starts in layouts(seq, args.cp).items():
                q, k, v = inputs(heads, (seq // args.cp), seq)
                variants = {f"local_attention, {kern}": ours(kern, starts) for kern in args.kernels}
                padded = torch.zeros(1, seq, dtype=torch.long, device="cuda")
                padded[0, 0] = -1
                variants["local_attention, one padded key (flex)"] = ours("flash", starts, padded)
                for mean in args.documents:
                    tags = packed_tags(seq, mean)
                    variants[f"local_attention, packed documents of ~{mean} tokens (flex)"] = ours("flash", starts, tags)
                    if name.startswith("head_tail"):
                        variants[f"local_attention, ~{mean}-token documents cut per document (flex at positions)"] = \
                            ours("flash", starts, tags, rank_zero_per_document(tags, args.cp))
                variants["flash, is_causal per chunk (bottom-right)"] = flash_per_chunk(starts)
                for label, fn in variants.items():
                    try:
                        fwd, both, peak = measure(fn, q, k, v)
                        lines.append(f"| {name} | {heads} | {seq} | {label} | {fwd:.2f} | {both:.2f} | {peak:.2f} |")
                    except Exception as exc:  # noqa: BLE001 - a kernel that refuses is a row
                        lines.append(f"| {name} | {heads} | {seq} | {label} | {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0][:100]} | | |")
                    print(lines[-1], flush=True)
                del q, k, v
                torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
