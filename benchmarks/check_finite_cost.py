"""What ``CPCOMPILE_CHECK_FINITE=1`` costs a GDN region, on one GPU.

    python3 benchmarks/check_finite_cost.py [--T 16384 32768] [--out FILE]

A Qwen3.5-shaped GDN region of ``benchmarks/trainer_gpu.py``'s model (hidden 1024, 16 key / 16
value heads of 128): one linear to q, k, v, g, beta, cpcompile's Triton core (q/k normalised in
it), one linear back; bf16. Timed forward + backward as is, and inside ``finite.FiniteGuard`` the
way an installed region calls it: its forward output and its input gradient checked. One GPU has
no cp group, so the guard's small all-gather per check (8 bytes a rank) is not in these numbers.
Median of ``repeat`` after ``warmup`` (CUDA events).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gdn_kernels import time_cuda, write_report  # noqa: E402

HIDDEN, HEADS, DIM = 1024, 16, 128


class GDNRegion(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Linear(HIDDEN, 3 * HEADS * DIM + 2 * HEADS, bias=False)
        self.proj_out = torch.nn.Linear(HEADS * DIM, HIDDEN, bias=False)

    def forward(self, x):
        from cpcompile.kernels import chunk_gated_delta_rule

        B, T, _ = x.shape
        qkv, a, b = self.proj_in(x).split([3 * HEADS * DIM, HEADS, HEADS], dim=-1)
        q, k, v = qkv.view(B, T, 3, HEADS, DIM).unbind(2)
        g = torch.nn.functional.logsigmoid(a.float())
        o, _ = chunk_gated_delta_rule(q, k, v, g, torch.sigmoid(b), use_qk_l2norm_in_kernel=True)
        return self.proj_out(o.reshape(B, T, HEADS * DIM))


def main():
    from cpcompile.finite import FiniteGuard

    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    region = GDNRegion().cuda().to(torch.bfloat16)
    guard = FiniteGuard("gdn region")
    rows = []
    for T in args.T:
        x = torch.randn(1, T, HIDDEN, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(1, T, HIDDEN, device="cuda", dtype=torch.bfloat16)

        def fresh():  # a new input each step, as a layer gets (a hook stays on the tensor it was put on)
            return [x.detach().requires_grad_()]
        plain = time_cuda(lambda: region(*fresh()).backward(dy), args.warmup, args.repeat)
        checked = time_cuda(lambda: guard.around(fresh(), lambda leaves: region(*leaves)).backward(dy),
                            args.warmup, args.repeat)
        rows.append(f"| {T} | {args.warmup}/{args.repeat} | {plain:.3f} | {checked:.3f} | "
                    f"{checked - plain:+.3f} | {100 * (checked / plain - 1):+.1f}% |")
        print(rows[-1], flush=True)
    lines = ["# Cost of CPCOMPILE_CHECK_FINITE=1 on a GDN region", "",
             f"torch {torch.__version__}, {torch.cuda.get_device_name()}. Command: "
             "`python3 benchmarks/check_finite_cost.py`. Region: hidden 1024 -> q, k, v (16 heads of 128), g, beta -> "
             "Triton GDN core -> hidden 1024, bf16, batch 1; forward + backward.", "",
             "| tokens | warmup/repeat | fwd+bwd ms | with the guard ms | difference ms | overhead |",
             "|---|---|---|---|---|---|", *rows]
    write_report(lines, args.out, "check_finite_cost", torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
