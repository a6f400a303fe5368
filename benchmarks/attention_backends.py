"""Whole-sequence causal attention at the trainer model's shape, by SDPA backend (one GPU, bf16).

    python benchmarks/attention_backends.py [--seq 32768 131072] [--heads 8 2 256] [--out FILE]

At cp 1 the trainer does not rewrite attention: the model's own SDPA call runs, and PyTorch picks
its backend (cuDNN's in the trainer on an H200 with torch 2.11: `trainer_gpu.py --profile`; this
script times each backend forced, not PyTorch's pick). Under CP our local kernels prefer cuDNN, 1.5-1.7x
flash at head dim 64/128 (local_attention.py). This asks the same of the 0.57B model's attention
(8 query heads, 2 KV heads of 256): each backend PyTorch has, forward and forward+backward
(median ms, triton.testing.do_bench), with grouped heads passed as they are (`enable_gqa`) or
expanded to the query heads first (the expansion's copy and its backward included). A backend that
refuses the call says so.
"""
from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention(q, k, v, backend: str, expand: bool):
    groups = q.shape[1] // k.shape[1]
    if expand and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with sdpa_kernel(BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not expand and groups > 1)


def time_backend(seq: int, heads: tuple[int, int, int], backend: str, expand: bool) -> str:
    from triton.testing import do_bench

    query_heads, kv_heads, dim = heads
    gen = torch.Generator(device="cuda").manual_seed(seq)

    def leaf(h):
        return torch.randn(1, h, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    q, k, v = leaf(query_heads), leaf(kv_heads), leaf(kv_heads)
    grad = torch.randn(1, query_heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    try:
        reference = attention(q, k, v, "flash", False)
        out = attention(q, k, v, backend, expand)
        error = float((out.float() - reference.float()).norm() / reference.float().norm())
        fwd = do_bench(lambda: attention(q, k, v, backend, expand), warmup=3, rep=30)
        both = do_bench(lambda: attention(q, k, v, backend, expand).backward(grad), warmup=3, rep=30,
                        grad_to_none=[q, k, v])
    except torch.OutOfMemoryError:
        raise  # not a refusal: the row would mislead
    except RuntimeError as exc:  # SDPA's "No available kernel" and the kernels' own shape checks
        return f"refused: {str(exc).splitlines()[0][:120]} | | |"
    flops = 4 * seq * seq * query_heads * dim / 2  # QK^T and PV, causal half
    return f"{fwd:.2f} | {both:.2f} | {flops * 3.5 / both / 1e9:.0f} | {error:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, nargs=3, default=[8, 2, 256], help="query heads, KV heads, head dim")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = ["| S | backend | grouped heads | fwd ms | fwd+bwd ms | TFLOP/s (fwd+bwd, 3.5x fwd FLOPs) | "
             "rel diff vs flash |", "|---|---|---|---|---|---|---|"]
    for seq in args.seq:
        for backend in BACKENDS:
            for expand in (False, True):
                row = time_backend(seq, tuple(args.heads), backend, expand)
                lines.append(f"| {seq} | {backend} | {'expanded' if expand else 'enable_gqa'} | {row} |")
                print(lines[-1], flush=True)
    text = (f"# SDPA backends at heads {tuple(args.heads)}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"{datetime.date.today()}\n\n`python benchmarks/attention_backends.py {' '.join(sys.argv[1:])}`\n\n"
            + "\n".join(lines) + "\n")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
