"""Is plain Head-Tail balanced enough for packed documents? Causal attention work per CP rank.

    python benchmarks/packed_balance.py [--seq 131072] [--cp 2 4 8] [--out FILE]     (CPU, seconds)

A query attends to the keys of its own document up to itself, so a token's work is its position
in its document + 1 (query-key pairs; the kernels skip the rest). For documents drawn from
several length mixes, the table gives each layout's busiest rank over the mean (1.00 = perfectly
balanced; the step waits for the busiest rank), each the worst of 20 random packings:
- contiguous blocks (AllGather, Ulysses' input split);
- Head-Tail over the packed sequence (rank r holds chunks r and 2·cp−1−r), what cpcompile ran on
  packed batches before per-document Head-Tail;
- per-document Head-Tail, what `shard_batch` now does with a packed batch under a Head-Tail plan:
  the token order of `cpcompile.documents.per_document_head_tail` itself (every document cut into
  2·cp pieces, rank r holds pieces r and 2·cp−1−r of each, S/cp tokens per rank).
Ulysses itself computes whole documents on a share of the heads and is balanced by construction.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

import torch

MIXES = {  # name -> sampler of one document length
    "one document": lambda g, s: s,
    "fixed 4K": lambda g, s: 4096,
    "fixed 16K": lambda g, s: 16384,
    "log-normal, median 2K": lambda g, s: int(torch.empty(1).log_normal_(7.6, 1.0, generator=g).clamp(16, s)),
    "log-normal, median 8K": lambda g, s: int(torch.empty(1).log_normal_(9.0, 1.0, generator=g).clamp(16, s)),
    "one 64K document among 1K ones": None,  # built below
}


def packing(mix: str, seq: int, seed: int) -> torch.Tensor:
    """Position ids of one packed row: restarting at 0 at every document."""
    g = torch.Generator().manual_seed(seed)
    if MIXES[mix] is None:
        lengths, start = [1024] * ((seq - 65536) // 1024), int(torch.randint(0, (seq - 65536) // 1024, (1,), generator=g))
        lengths.insert(start, 65536)
    else:
        lengths, total = [], 0
        while total < seq:
            lengths.append(min(MIXES[mix](g, seq), seq - total))
            total += lengths[-1]
    return torch.cat([torch.arange(n) for n in lengths])[:seq]


LAYOUTS = ("contiguous", "head_tail", "per-document head-tail")


def rank_work(positions: torch.Tensor, cp: int, layout: str) -> torch.Tensor:
    work = (positions + 1).double()
    if layout == "contiguous":
        return work.view(cp, -1).sum(1)
    if layout == "head_tail":
        return head_tail_work(work, cp)
    from cpcompile.documents import per_document_head_tail

    order = per_document_head_tail(positions[None], cp)[0]
    return work[order].view(cp, -1).sum(1)


def head_tail_work(work: torch.Tensor, cp: int) -> torch.Tensor:
    """Rank r's share of `work` cut into 2·cp near-equal pieces: pieces r and 2·cp−1−r."""
    edges = [len(work) * i // (2 * cp) for i in range(2 * cp + 1)]
    pieces = [work[a:b].sum() for a, b in zip(edges[:-1], edges[1:])]
    return torch.stack([pieces[r] + pieces[2 * cp - 1 - r] for r in range(cp)])


def imbalance(positions: torch.Tensor, cp: int, layout: str) -> float:
    work = rank_work(positions, cp, layout)
    return (work.max() / work.mean()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [f"# Causal attention work per rank, packed documents — {_dt.date.today().isoformat()}", "",
             f"S = {args.seq} tokens; busiest rank / mean rank (1.00 = balanced), worst of {args.seeds} packings. "
             "Produced by `benchmarks/packed_balance.py` (work counted, nothing timed).", "",
             "| documents | " + " | ".join(f"CP={cp} {layout}" for cp in args.cp for layout in LAYOUTS) + " |",
             "|---|" + "---|" * len(LAYOUTS) * len(args.cp)]
    for mix in MIXES:
        cells = []
        for cp in args.cp:
            packings = [packing(mix, args.seq, seed) for seed in range(args.seeds)]
            cells += [f"{max(imbalance(p, cp, layout) for p in packings):.2f}" for layout in LAYOUTS]
        lines.append(f"| {mix} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
