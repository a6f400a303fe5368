"""Masked local attention (padding, packed documents) against the unmasked kernels per unit of visible work.

    python benchmarks/masked_attention.py [--quick] [--seq 8192 32768 131072] [--cp2] [--out FILE]   (CUDA, bf16)

Issue 48 item 3: masked attention within 1.2x of the unmasked cuDNN path for the same visible work,
forward+backward. Head layouts GQA 8/2 x 256 (Qwen3.5's) and 16/4 x 128; one rank of cp 1 (the whole
causal sequence; `--cp2` adds CP=2's last AllGather rank: S/2 queries at S/2 against S keys); batches
unpadded, 10% padding at the end, packed documents (~2K, ~8K tokens, seeded). Rows:
- unmasked `chunk_attention` on cudnn and flash (unpadded batch only: the reference);
- `local_attention(..., unmasked=False)` on `masked_kernel="varlen"` (flash's variable-length kernel, what
  cpcompile runs since 2026-12-06) and on `"flex"` (FlexAttention, what it ran before);
- FlexAttention under the same block mask (`kernels/attention/flex.py`) with other `kernel_options`
  (at the lengths `--options-at` names, 32K by default: each setting compiles anew per length);
- `torch.nn.attention.varlen.varlen_attn` (flash) over cu_seq_q/cu_seq_k, a segment per run of equal key
  tags (a document, or a padding run attending only to itself), with exact max_q/max_k and with the
  chunk's bounds (which need no read-back; the cu_seqlens here do: `nonzero` over the tags);
- with `--cudnn-ragged`: cuDNN's ragged path (`aten._cudnn_attention_forward` with cum_seq_q/cum_seq_k);
- at S <= 8K only: SDPA with a dense S x S boolean mask, what transformers does today.
Visible work: visible (query, key) pairs of real queries over the rank's causal square; "rel": ms per
unit visible work over unmasked cuDNN's on the unpadded batch (target <= 1.2). Median ms
(triton.testing.do_bench); peak GiB of one forward+backward above the inputs. Then every kernel is
checked against the float64 oracle (`naive_attention`) at S=1024. The kernels: `masked_attention_kernels.py`.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpcompile.kernels.attention.naive import naive_attention  # noqa: E402
from masked_attention_kernels import (_varlen_api, dense_mask_sdpa, masked_kernels, tag_runs,  # noqa: E402
                                      unmasked)

HEADS = {"gqa 8/2 x 256": (8, 2, 256), "gqa 16/4 x 128": (16, 4, 128)}


def batch_tags(kind: str, keys: int, device) -> torch.Tensor:
    """`[1, S]` key tags (`kernels/attention/layout.py`): unpadded, 10% padding at the end, or packed
    documents of random lengths around N tokens (seeded: the same row on every run)."""
    tags = torch.zeros(1, keys, dtype=torch.long)
    if kind == "pad 10%":
        tags[0, keys - keys // 10:] = -1
    elif kind.startswith("docs"):
        mean = int(kind.split("~")[1].rstrip("K")) * 1024
        starts = torch.rand(keys, generator=torch.Generator().manual_seed(0)) < 1 / mean
        starts[0] = False
        tags = starts.long().cumsum(0)[None]
    return tags.to(device)


def visible_work(tags: torch.Tensor, start: int, length: int) -> float:
    """Visible pairs of the real queries `[start, start+length)` over the rank's causal square (documents
    are contiguous runs, so a real query at p sees its run's keys up to p)."""
    row = tags[0].cpu()
    starts, ends = tag_runs(row)
    run_start = starts.repeat_interleave(ends - starts)
    pos = torch.arange(start, start + length)
    seen = torch.where(row[pos] >= 0, pos - run_start[pos] + 1, 0).sum().item()
    return seen / (pos + 1).sum().item()


def inputs(heads: tuple[int, int, int], rows: int, keys: int, seed: int = 0):
    hq, hkv, d = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h, s: torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                    generator=gen).transpose(1, 2).requires_grad_()
    return make(hq, rows), make(hkv, keys), make(hkv, keys)


def check_tags(keys: int) -> torch.Tensor:
    """Documents of ~150 tokens, then 10% padding: every case of the masked kernels at once."""
    tags = (torch.rand(keys, generator=torch.Generator().manual_seed(1)) < 1 / 150).long().cumsum(0)
    tags[keys - keys // 10:] = -(tags[keys - keys // 10 - 1] + 1)  # padding of the last document
    return tags[None].cuda()


def check(name: str, fn, heads, starts: list[int], masked: bool = True, keys: int = 1024) -> str:
    """Max abs error of out (real query rows) and dq/dk/dv against the float64 oracle, on documents and
    padding (`masked`) or one unpadded document; the output gradient is zero on padded query rows,
    whose outputs no kernel defines alike."""
    rows = keys - starts[0]
    q, k, v = inputs(heads, rows, keys, seed=1)
    tags = check_tags(keys) if masked else batch_tags("unpadded", keys, "cuda")
    real = (tags[0, starts[0]:] >= 0)[None, None, :, None]
    grad = torch.randn(q.shape, device="cuda", dtype=q.dtype) * real
    try:
        got = fn(q, k, v, tags, starts)
        dgot = torch.autograd.grad(got, (q, k, v), grad)
    except Exception as exc:  # noqa: BLE001 - a kernel that refuses is a line
        return f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = naive_attention(qd, kd, vd, starts, key_tags=tags.cpu())
    dwant = torch.autograd.grad(want, (qd, kd, vd), grad.double())
    errs = [((got.double() - want) * real).abs().max()] + [(a.double() - b).abs().max() for a, b in zip(dgot, dwant)]
    return f"{name}: max abs error out {errs[0]:.1e}, dq {errs[1]:.1e}, dk {errs[2]:.1e}, dv {errs[3]:.1e}"


def measure(fn, q, k, v, tags, starts) -> tuple[float, float, float]:
    from triton.testing import do_bench

    grad = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    call = lambda: fn(q, k, v, tags, starts)  # noqa: E731
    fwd = do_bench(call, warmup=25, rep=100, return_mode="median")
    both = do_bench(lambda: torch.autograd.grad(call(), (q, k, v), grad), warmup=25, rep=100, return_mode="median")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(call(), (q, k, v), grad)
    torch.cuda.synchronize()
    return fwd, both, (torch.cuda.max_memory_allocated() - base) / 2**30


def layouts(seq: int, cp2: bool) -> dict[str, list[int]]:
    out = {"cp 1": [0]}
    if cp2:
        out["cp 2 all_gather (last rank)"] = [seq // 2]
    return out


def rows_of(heads_name: str, seq: int, layout: str, args):
    """(batch kind, kernel name, fn) of one (heads, S, layout): the unmasked references on the unpadded
    batch, every masked kernel on every batch."""
    d = HEADS[heads_name][2]
    for kind in ["unpadded", "pad 10%", "docs~2K", "docs~8K"][:3 if args.quick else 4]:
        if kind == "unpadded":
            yield kind, "unmasked cudnn (reference)", unmasked("cudnn")
            yield kind, "unmasked flash", unmasked("flash")
            continue
        for name, fn in masked_kernels(d, args, seq in args.options_at).items():
            if not args.kernels or any(part in name for part in args.kernels):
                yield kind, name, fn
        if seq <= 8192 and layout == "cp 1":
            yield kind, "sdpa + dense S x S bool mask (transformers today)", dense_mask_sdpa


def run_table(args, lines: list[str]) -> None:
    for heads_name, heads in HEADS.items():
        for seq in args.seq:
            for layout, starts in layouts(seq, args.cp2).items():
                q, k, v = inputs(heads, seq - starts[0], seq)
                reference = {}
                for kind, name, fn in rows_of(heads_name, seq, layout, args):
                    head = f"| {layout} | {heads_name} | {seq} | {kind} | {name} |"
                    emit(lines, table_row(head, name, fn, (q, k, v), batch_tags(kind, seq, "cuda"), starts, reference))
                del q, k, v
                torch.cuda.empty_cache()


def table_row(head: str, name: str, fn, qkv, tags, starts: list[int], reference: dict) -> str:
    """One row; `reference` keeps unmasked cuDNN's (fwd, fwd+bwd) ms of this (heads, S, layout), or
    flash's (marked) where cuDNN failed."""
    work = visible_work(tags, starts[0], qkv[0].shape[2])
    try:
        fwd, both, peak = measure(fn, *qkv, tags, starts)
    except Exception as exc:  # noqa: BLE001 - a kernel that refuses is a row
        return f"{head} {type(exc).__name__}: {str(exc).splitlines()[0][:120]} | | {work:.3f} | | | |"
    if name.startswith("unmasked cudnn") or (name.startswith("unmasked flash") and not reference):
        reference.update(ms=(fwd, both), note="" if "cudnn" in name else " (vs flash: cudnn failed)")
    rel = [f"{t / work / r:.2f}{reference['note']}" for t, r in zip((fwd, both), reference["ms"])] \
        if reference else ["", ""]
    return f"{head} {fwd:.2f} | {both:.2f} | {work:.3f} | {rel[0]} | {rel[1]} | {peak:.2f} |"


def run_checks(args, lines: list[str]) -> None:
    lines += ["", "Correctness at S=1024 (documents of ~150 tokens, last 10% padding), max abs error against the "
              "float64 oracle (`naive_attention`):", ""]
    for heads_name, heads in HEADS.items():
        for layout, starts in layouts(1024, args.cp2).items():
            checks = [("unmasked cudnn, one unpadded document (the bf16 yardstick)", unmasked("cudnn"), False)]
            checks += [(name, fn, True) for name, fn in masked_kernels(heads[2], args, args.check_options).items()]
            for name, fn, masked in checks:
                try:
                    emit(lines, f"- {layout}, {heads_name}, " + check(name, fn, heads, starts, masked))
                except Exception as exc:  # noqa: BLE001 - the oracle or setup failing is a line too
                    emit(lines, f"- {layout}, {heads_name}, {name}: check failed, {type(exc).__name__}: {exc}"[:300])


def emit(lines: list[str], line: str) -> None:
    lines.append(line)
    print(line, flush=True)


def describe_torch() -> str:
    varlen_attn = _varlen_api()
    if varlen_attn is None:
        return f"torch {torch.__version__}; torch.nn.attention.varlen.varlen_attn: absent"
    params = inspect.signature(varlen_attn).parameters
    how = ("causal by " + ("is_causal=True" if "is_causal" in params else "window_size=(-1, 0)") + ", GQA by "
           + ("enable_gqa=True" if "enable_gqa" in params else "K/V repeated to the query heads (no enable_gqa)"))
    return (f"torch {torch.__version__}; torch.nn.attention.varlen.varlen_attn{inspect.signature(varlen_attn)}; "
            f"the varlen rows call it with {how}")


def raise_recompile_limits() -> None:
    """Every (S, kernel_options) compiles FlexAttention anew (dynamic=False): past the default limit of 8
    Dynamo would silently run flex_attention eagerly, a dense quadratic path."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 1024
    torch._dynamo.config.accumulated_cache_size_limit = 4096


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", help="default 8192 32768 131072 (--quick: 8192 32768)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer rows: 8K and 32K, no ~8K-document batch, one kernel_options setting per head size")
    parser.add_argument("--cp2", action="store_true", help="also the last AllGather rank of CP=2")
    parser.add_argument("--options-at", type=int, nargs="*", default=[32768],
                        help="lengths that also get the FlexAttention kernel_options rows (default 32768)")
    parser.add_argument("--check-options", action="store_true",
                        help="also check the kernel_options settings (one more compilation each)")
    parser.add_argument("--cudnn-ragged", action="store_true", help="also cuDNN's ragged path (see masked_kernels)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    parser.add_argument("--kernels", nargs="*", default=None,
                        help="time only the masked kernels whose names hold one of these (e.g. local_attention)")
    parser.add_argument("--out", default=None, help="write the table as markdown")
    args = parser.parse_args(argv)
    args.seq = args.seq or ([8192, 32768] if args.quick else [8192, 32768, 131072])
    header = describe_torch()
    print(header, flush=True)
    if not torch.cuda.is_available():
        print("masked_attention: needs CUDA (bf16 fused kernels); nothing measured", file=sys.stderr)
        return 1
    raise_recompile_limits()
    command = " ".join(["python benchmarks/masked_attention.py", *sys.argv[1:]])
    lines = [f"# Masked vs unmasked local attention — {_dt.date.today().isoformat()}, "
             f"{torch.cuda.get_device_name()}, bf16", "", header, "", f"Command: `{command}`", "",
             "| layout | heads | S | batch | kernel | fwd ms | fwd+bwd ms | visible work | rel fwd | rel fwd+bwd | "
             "peak GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    run_table(args, lines)
    if not args.no_check:
        run_checks(args, lines)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0



if __name__ == "__main__":
    sys.exit(main())
