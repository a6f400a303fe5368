"""Where the Triton GDN kernels lose accuracy in bf16: gradients against a float64 oracle, per variant.

    python3 benchmarks/gdn_accuracy.py [--T 4096] [--seeds 1 2] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/gdn_accuracy.py --smoke   # CPU, tiny shape, no accuracy claim

Same bf16 inputs for every variant (Qwen3.5 shapes: B=1, 16 key / 32 value heads, K=V=128, fp32 g,
q/k L2-normalised in the op); each line is the relative L2 error of o and of every input gradient
against the eager oracle run in float64 on the same (rounded) inputs. Each variant changes one thing:

- ``kernels as shipped``: what ``chunk_gated_delta_rule(..., backend="triton")`` runs;
- ``dq/dk rounded to bf16 before the L2-norm backward``: the order two custom ops imposed before
  the norm moved inside the core op;
- ``fp32 dots at tf32x3``: every fp32 x fp32 dot of the bf16 kernels at tf32x3 instead of tf32;
- ``fp32 kernels``: the same inputs upcast to fp32 (the floor of the algorithm at tf32x3);
- ``fla-core`` when it is installed (its Hopper guard lifted; its gradients are only compared).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gdn_kernels import B, DK, DV, HK, HV, make_inputs, write_report  # noqa: E402

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def oracle(xs, do):
    from cpcompile.kernels.gdn.eager import chunk_gated_delta_rule_eager

    leaves = [x.detach().double().requires_grad_() for x in xs]
    o = chunk_gated_delta_rule_eager(*leaves, use_qk_l2norm_in_kernel=True)[0]
    o.backward(do.double())
    return [o.detach()] + [x.grad for x in leaves]


@contextlib.contextmanager
def dot_precision(prec):
    """Every kernel launched inside runs its fp32 x fp32 dots at ``prec``."""
    from cpcompile.kernels.gdn.triton import launch as L

    saved = L._flags

    def flags(dtype):
        out = saved(dtype)
        return {**out, "PREC": prec} if not out["UPCAST"] else out
    L._flags = flags
    try:
        yield
    finally:
        L._flags = saved


def two_op_order(xs, do):
    """The order before the norm moved into the core op: the core's dq/dk rounded to bf16, then the
    norm's backward (here in fp32 PyTorch, the formula of the removed kernel)."""
    from cpcompile.kernels.gdn.triton import launch as L

    q, k, v, g, beta = (x.detach() for x in xs)
    (qn, q_rstd), (kn, k_rstd) = L.l2norm_fwd(q), L.l2norm_fwd(k)
    scale = k.shape[-1] ** -0.5  # the op's default, as the API path uses
    o, _, gc, w, u, tinv = L.gdn_fwd(qn, kn, v, g, beta, None, scale)
    dq, dk, dv, dg, dbeta, _ = L.gdn_bwd(qn, kn, v, g, beta, None, gc, w, u, tinv, do, None, scale)

    def norm_bwd(x, r, dy):
        y, dy = x.float() * r[..., None], dy.float()
        return (r[..., None] * (dy - y * (y * dy).sum(-1, keepdim=True))).to(x.dtype)
    return [o, norm_bwd(q, q_rstd, dq), norm_bwd(k, k_rstd, dk), dv, dg, dbeta]


def api(xs, do):
    from cpcompile.kernels import chunk_gated_delta_rule

    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o = chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True, backend="triton")[0]
    o.backward(do)
    return [o.detach()] + [x.grad for x in leaves]


def fla(xs, do):
    import fla.ops.common.chunk_o as fla_chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # compared only, see gdn_kernels.py
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o = chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)[0]
    o.backward(do)
    return [o.detach()] + [x.grad for x in leaves]


def variants(has_fla):
    def tf32x3(xs, do):
        with dot_precision("tf32x3"):
            return api(xs, do)

    out = {
        "kernels as shipped (API)": api,
        "dq/dk rounded to bf16 before the L2-norm backward (the old two-op order)": two_op_order,
        "fp32 x fp32 dots at tf32x3 instead of tf32": tf32x3,
        "fp32 kernels on the same (bf16-valued) inputs": lambda xs, do: api(
            [x.float() if x.dtype == torch.bfloat16 else x for x in xs], do.float()),
    }
    if has_fla:
        out["fla-core 0.6.0 (guard lifted)"] = fla
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape: checks the script runs")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dims = (1, 1, 2, 32, 32) if args.smoke else None
    T = 128 if args.smoke else args.T
    try:
        import fla  # noqa: F401
        has_fla = not args.smoke
    except ImportError:
        has_fla = False
    rows = {}
    for seed in args.seeds:
        xs, do = make_inputs(T, seed=seed, dims=dims, device=device)
        ref = oracle(xs, do)
        for name, fn in variants(has_fla).items():
            try:
                errs = [rel(a, b) for a, b in zip(fn(xs, do), ref)]
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: {exc!r}", flush=True)
                continue
            rows.setdefault(name, []).append(errs)
            print(f"  seed {seed} {name}: " + ", ".join(f"{n} {e:.1e}" for n, e in zip(NAMES, errs)), flush=True)
    shape = dims or (B, HK, HV, DK, DV)
    lines = [f"Accuracy at T={T}, shapes (B,Hk,Hv,K,V)={shape}, bf16 inputs; relative L2 error against the "
             f"float64 eager oracle on the same inputs, mean over seeds {args.seeds}.", "",
             "| variant | " + " | ".join(NAMES) + " |", "|---|" + "---|" * len(NAMES)]
    for name, errs in rows.items():
        mean = [sum(e[i] for e in errs) / len(errs) for i in range(len(NAMES))]
        lines.append(f"| {name} | " + " | ".join(f"{m:.1e}" for m in mean) + " |")
    print("\n".join(lines))
    if not args.smoke:
        write_report(lines, args.out, "gdn_accuracy", torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
