"""Benchmark the GDN layer's causal depthwise conv + SiLU: PyTorch's depthwise `F.conv1d` (the eager
layer's path until now) vs cpcompile's Triton op `cpcompile::gdn_conv` vs `conv_taps` compiled (what
a compiled layer runs), forward and forward+backward.

    python benchmarks/gdn_conv.py [--T 8192 32768 131072] [--C 6144] [--warmup 10] [--repeat 50] [--bias] [--out FILE]
    python benchmarks/gdn_conv.py --tune [--T 32768]   # the Triton op's tiles and warps (`triton/conv.py`)
    TRITON_INTERPRET=1 python benchmarks/gdn_conv.py --smoke [--tune]    # CPU, tiny shape, no timing claim

Each method goes from the projection's token-major output `x [B, T, C]` (bf16) to the SiLU'd conv
as `[B, T, C]` (the layout q, k and v are split from), as the adapter states it
(`adapters/qwen3_5.gdn_core_inputs`): for `F.conv1d` and the taps the transpose, the K − 1 zero
pad, the conv in the weight's dtype and the SiLU (its result a token-strided view); for the Triton
op one call, contiguous out. With positions (packed documents of 1 to 4K tokens) the eager baseline
is `conv_taps` eagerly (`F.conv1d` cannot stop at a document start). The backward is every
gradient (x, weight, bias with --bias). Times: median of `repeat` CUDA-event timings after `warmup`;
peak: the largest allocation above what was allocated before one forward+backward. The layout copies
after the conv (v made contiguous by the core) are not in these times.
"""
from __future__ import annotations

import argparse
import datetime as _dt

import torch
import torch.nn.functional as F

from cpcompile.kernels.gdn.conv import conv_silu_tokens, conv_taps
from gdn_kernels import time_cuda  # the GDN benchmarks' one timer (median of CUDA events; once on CPU)

KERNEL = 4


def conv1d_silu(x, weight, bias, positions):
    """The eager layer before the Triton conv: `F.conv1d` (`conv_taps` eagerly with positions)."""
    history = F.pad(x.transpose(1, 2).to(weight.dtype), (KERNEL - 1, 0))
    if positions is None:
        conv = F.conv1d(history, weight, bias, groups=history.shape[1])
    else:
        conv = conv_taps(history, weight, bias, positions)
    return F.silu(conv).to(x.dtype).transpose(1, 2)


def taps_silu(x, weight, bias, positions):
    """What a compiled layer traces: the taps in fp32, fused by inductor."""
    history = F.pad(x.transpose(1, 2).to(weight.dtype), (KERNEL - 1, 0))
    wide = torch.float32
    conv = conv_taps(history.to(wide), weight.to(wide), None if bias is None else bias.to(wide), positions)
    return F.silu(conv.to(history.dtype)).to(x.dtype).transpose(1, 2)


def methods(smoke: bool) -> dict:
    compiled = torch.compile(taps_silu, backend="aot_eager" if smoke else "inductor", dynamic=False)
    return {"F.conv1d + SiLU (eager)": conv1d_silu, "triton cpcompile::gdn_conv": conv_silu_tokens,
            "conv_taps compiled": compiled}


def document_positions(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Positions of packed documents of 1 to 4096 tokens (some of one token), per row."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        pos, filled = [], 0
        while filled < length:
            size = int(torch.randint(1, 4097, (1,), generator=gen)) if torch.rand(1, generator=gen) > 0.1 else 1
            size = min(size, length - filled)
            pos.append(torch.arange(size))
            filled += size
        rows.append(torch.cat(pos))
    return torch.stack(rows)


def peak_mib(fn, cuda: bool) -> str:
    if not cuda:
        return "-"
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - before) / 2**20:.0f}"


def bench(name, fn, x, weight, bias, positions, truth, warmup, repeat, cuda) -> str:
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    bias = bias.detach().requires_grad_() if bias is not None else None
    leaves = [x, weight] + ([bias] if bias is not None else [])
    grad = torch.randn_like(x)

    def forward():
        with torch.no_grad():
            return fn(x, weight, bias, positions)

    def step():
        torch.autograd.grad(fn(x, weight, bias, positions), leaves, grad)

    err = (forward().double() - truth).abs().max().item() / truth.abs().max().item()
    fwd, both = time_cuda(forward, warmup, repeat), time_cuda(step, warmup, repeat)
    shape = f"[{x.shape[0]}, {x.shape[1]}, {x.shape[2]}]"
    docs = "documents" if positions is not None else "-"
    return (f"| {name} | {shape} | {docs} | {warmup}/{repeat} | {fwd:.3f} | {both:.3f} | {peak_mib(step, cuda)} "
            f"| {err:.1e} |")


def oracle(x, weight, bias, positions):
    """float64 conv_taps + SiLU."""
    history = F.pad(x.double().transpose(1, 2), (KERNEL - 1, 0))
    conv = conv_taps(history, weight.double(), None if bias is None else bias.double(), positions)
    return F.silu(conv).transpose(1, 2)


def run(lengths, channels, warmup, repeat, with_bias, smoke) -> list[str]:
    cuda = not smoke
    device, dtype = ("cuda" if cuda else "cpu"), torch.bfloat16
    lines = ["| method | x [B, T, C] | positions | warmup/repeat | fwd ms | fwd+bwd ms | peak MiB (step) "
             "| max err (fwd, rel. to float64) |", "|---|---|---|---|---|---|---|---|"]
    table = methods(smoke)
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        x = torch.randn(1, length, channels, generator=gen).to(device, dtype)
        weight = (torch.randn(channels, 1, KERNEL, generator=gen) / 2).to(device, dtype)
        bias = torch.randn(channels, generator=gen).to(device, dtype) if with_bias else None
        for positions in (None, document_positions(1, length).to(device)):
            truth = oracle(x, weight, bias, positions)
            for name, fn in table.items():
                try:
                    lines.append(bench(name, fn, x, weight, bias, positions, truth, warmup, repeat, cuda))
                except Exception as exc:  # a table row says why, the others still run
                    docs = "documents" if positions is not None else "-"
                    lines.append(f"| {name} | T={length} | {docs} | failed: {exc!r} |||||")
                print(lines[-1], flush=True)
            del truth
    return lines


def tune(length: int, channels: int, warmup: int, repeat: int, smoke: bool) -> list[str]:
    """Time the Triton op's forward (alone) and backward (in a forward+backward, the forward at its
    default) over token tile x channel tile x warps; -> a table, the fastest of each kernel starred."""
    from cpcompile.kernels.gdn.triton import conv as kernels

    device = "cpu" if smoke else "cuda"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, length, channels, generator=gen).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(channels, 1, KERNEL, generator=gen) / 2).to(device, torch.bfloat16).requires_grad_()
    grad = torch.randn_like(x)

    def fwd():
        with torch.no_grad():
            conv_silu_tokens(x, weight, None, None)

    def step():
        torch.autograd.grad(conv_silu_tokens(x, weight, None, None), [x, weight], grad)

    grid = [(16, 64, 4)] if smoke else [(bt, bc, w) for bt in (8, 16, 32, 64) for bc in (64, 128, 256)
                                         for w in (2, 4, 8)]
    defaults = {name: dict(getattr(kernels, name)) for name in ("CONV_BT", "CONV_BC", "CONV_WARPS")}
    rows = []
    try:
        for kernel, fn in (("fwd", fwd), ("bwd", step)):
            for bt, bc, warps in grid:
                for name, value in (("CONV_BT", bt), ("CONV_BC", bc), ("CONV_WARPS", warps)):
                    setattr(kernels, name, dict(defaults[name], **{kernel: value}))
                try:
                    rows.append([kernel, bt, bc, warps, f"{time_cuda(fn, warmup, repeat):.3f}"])
                except Exception as exc:  # e.g. out of registers or shared memory: the row says so
                    rows.append([kernel, bt, bc, warps, f"failed: {type(exc).__name__}"])
                print(rows[-1], flush=True)
    finally:
        for name, value in defaults.items():
            setattr(kernels, name, value)
    best = {k: min((r for r in rows if r[0] == k and not r[4].startswith("f")), key=lambda r: float(r[4]),
                   default=None) for k in ("fwd", "bwd")}
    lines = [f"Tiles at x [1, {length}, {channels}] bf16, no positions; bwd: the forward+backward step's ms.", "",
             "| kernel | BT | BC | warps | ms | |", "|---|---|---|---|---|---|"]
    return lines + [f"| {' | '.join(map(str, r))} | {'*' if r is best[r[0]] else ''} |" for r in rows]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--C", type=int, default=6144)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--bias", action="store_true", help="the conv with a bias (Qwen3.5's has none)")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    ap.add_argument("--tune", action="store_true", help="sweep the Triton op's tiles and warps at the first --T")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape, no timing claim")
    args = ap.parse_args(argv)
    if args.smoke:
        args.T, args.C, args.warmup, args.repeat = [40], 24, 0, 1
    elif args.tune and args.T == ap.get_default("T"):
        args.T = [32768]
    device = "cpu (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    head = [f"# GDN causal conv + SiLU, {_dt.date.today()}", "",
            f"torch {torch.__version__}, device {device}, bf16, K={KERNEL}, bias={args.bias}", ""]
    if args.tune:
        lines = head + tune(args.T[0], args.C, args.warmup, args.repeat, args.smoke)
    else:
        lines = head + run(args.T, args.C, args.warmup, args.repeat, args.bias, args.smoke)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
