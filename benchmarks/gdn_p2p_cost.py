"""Per-rank cost of GDN State-P2P vs a plain local pass of the same length (eager backend, CPU).

What one rank computes in P2P: the local summary (M, S), the state chain (P−1 steps of
M·H + S; communication left out, this is a single process), and the output given the
entering state. The baseline is the plain local pass of the same tokens. Forward and
forward+backward, median of repeats, runs interleaved.

    python benchmarks/gdn_p2p_cost.py [--lengths 1024 4096] [--repeat 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import cpcompile.kernels.gdn.layer_ops  # noqa: F401  (registers the ops)

ops = torch.ops.cpcompile


def inputs(length: int, heads_k: int, heads_v: int, dim: int):
    q = torch.nn.functional.normalize(torch.randn(1, length, heads_k, dim), dim=-1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(1, length, heads_k, dim), dim=-1).requires_grad_()
    v = torch.randn(1, length, heads_v, dim, requires_grad=True)
    g = (-torch.rand(1, length, heads_v) * 0.5).requires_grad_()
    beta = torch.rand(1, length, heads_v).requires_grad_()
    return q, k, v, g, beta


def plain(q, k, v, g, beta, chunk, ranks):
    return ops.gdn_chunk(q, k, v, g, beta, None, q.shape[-1] ** -0.5, chunk, "eager")


def p2p(q, k, v, g, beta, chunk, ranks):
    m, s = ops.gdn_summary(k, v, g, beta, chunk, "eager")
    state = torch.zeros_like(s)
    for _ in range(ranks - 1):  # the chain's arithmetic; the transfers are not timed here
        state = m @ state + s
    return ops.gdn_chunk(q, k, v, g, beta, state, q.shape[-1] ** -0.5, chunk, "eager")


def seconds(fn, args, backward: bool) -> float:
    start = time.perf_counter()
    out = fn(*args)
    if backward:
        out.sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--heads", type=int, nargs=2, default=[4, 8], metavar=("HK", "HV"))
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    print(f"eager backend, CPU, threads={torch.get_num_threads()}, fp32, B=1, heads K/V={args.heads}, "
          f"K=V={args.dim}, chunk={args.chunk}, chain of {args.ranks - 1} steps, "
          f"warmup={args.warmup} repeat={args.repeat} (median ms)")
    print(f"{'local T':>8} {'plain fwd':>10} {'p2p fwd':>10} {'ratio':>6} {'plain f+b':>10} {'p2p f+b':>10} {'ratio':>6}")
    for length in args.lengths:
        data = inputs(length, *args.heads, args.dim)
        row = []
        for backward in (False, True):
            times = {plain: [], p2p: []}
            for i in range(args.warmup + args.repeat):
                for fn in times:
                    elapsed = seconds(fn, (*data, args.chunk, args.ranks), backward)
                    if i >= args.warmup:
                        times[fn].append(elapsed)
            base, ours = (statistics.median(times[f]) * 1e3 for f in (plain, p2p))
            row += [base, ours, ours / base]
        print(f"{length:>8} {row[0]:>10.1f} {row[1]:>10.1f} {row[2]:>6.2f} {row[3]:>10.1f} {row[4]:>10.1f} {row[5]:>6.2f}")


if __name__ == "__main__":
    main()
