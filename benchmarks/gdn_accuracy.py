"""Where the Triton GDN kernels lose accuracy in bf16: gradients against a float64 oracle, per variant.

    python3 benchmarks/gdn_accuracy.py [--T 4096] [--seeds 1 2] [--out FILE]
    python3 benchmarks/gdn_accuracy.py --stress [--out FILE]   # every stress regime, ours against fla-core
    TRITON_INTERPRET=1 python benchmarks/gdn_accuracy.py --smoke [--stress]   # CPU, tiny shape, no accuracy claim

``--stress``: every regime of ``tests/kernels/gdn_stress.py`` (key cosine x gate scale) in three
layouts (100 and 1000 tokens with grouped heads and an initial state, packed documents),
cpcompile's Triton core and fla-core in fp32 and bf16, and the eager fp32 core, each against a
float64 oracle (on the GPU the eager chunk form in float64, equal to the recurrence to float64
rounding; the recurrence's tiny steps are too slow there): the output, the final state and all six
gradients. Written to
``results/gdn_stability_<date>_<device>.md``.

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
sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))  # gdn_stress: the adversarial inputs the tests use

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
    from cpcompile.kernels.gdn.triton import launching as L

    saved = L.flags

    def flags(dtype):
        out = saved(dtype)
        return {**out, "PREC": prec} if not out["UPCAST"] else out
    L.flags = flags
    try:
        yield
    finally:
        L.flags = saved


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
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from fla_guard import lift_fla_hopper_guard

    lift_fla_hopper_guard()  # compared only, see gdn_kernels.py
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o = chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)[0]
    o.backward(do)
    return [o.detach()] + [x.grad for x in leaves]


def fla_stress_core(layout):
    """fla-core's chunk_gated_delta_rule as a ``gdn_stress`` core (ImportError
    without fla-core)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from gdn_stress import cu_seqlens
    from fla_guard import lift_fla_hopper_guard

    lift_fla_hopper_guard()  # compared only, see gdn_kernels.py
    if os.environ.get("FLA_ONE_CONFIG") == "1":
        one_config_per_fla_kernel()

    def core(q, k, v, g, beta, h0):
        docs = layout.documents
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=docs is None,
                                      use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=None if docs is None else cu_seqlens(docs, q.device))
    return core


def one_config_per_fla_kernel() -> None:
    """Each autotuned fla-core kernel keeps only its shallowest config, so nothing is tuned (a tuning
    round compiles every config, minutes per dtype and layout on the device's clock). Configs
    choose speed, not results: for accuracy only, never for timing (``FLA_ONE_CONFIG=1``)."""
    from triton.runtime.autotuner import Autotuner

    for name, module in list(sys.modules.items()):
        if not name.startswith("fla."):
            continue
        for obj in vars(module).values():
            while obj is not None and not isinstance(obj, Autotuner):  # under @triton.heuristics
                obj = getattr(obj, "fn", None)
            if obj is not None and len(obj.configs) > 1:
                obj.configs = [min(obj.configs, key=lambda c: (c.num_stages or 0, abs((c.num_warps or 4) - 4)))]


def stress_layouts(smoke: bool):
    from gdn_stress import Layout

    if smoke:
        return {"one chunk": Layout(1, 64, 1, 2, 16, 16)}
    return {  # one chunk is in the CPU interpreter's set (tests/kernels/test_gdn_stress.py)
        "T=100, h0": Layout(1, 100, 2, 4, 128, 128, initial_state=True),
        "T=1000, h0": Layout(1, 1000, 2, 4, 128, 128, initial_state=True),
        "cu_seqlens (300, 517, 207)": Layout(1, 1024, 2, 4, 128, 128, documents=(300, 517, 207)),
    }


def stress(args):
    """One row per layout and regime: the worst relative error over o, the final state and every
    gradient, for each core and dtype, and which quantity it was."""
    from gdn_stress import REGIMES, Regime

    regimes = (Regime(0.75, 0.0), Regime(0.0, 1.0)) if args.smoke else REGIMES
    device = "cpu" if args.smoke else "cuda"
    cores = {"eager fp32": ("eager", torch.float32)}
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        cores[f"ours {name}"] = ("triton", dtype)
        if not args.smoke:
            cores[f"fla-core {name}"] = ("fla", dtype)
    header = ["layout", "regime"] + list(cores) + ["ours <= fla-core (fp32 / bf16)"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    worse = []
    try:  # `timeout -s INT`: the report holds the rows measured so far
        _stress_rows(args, regimes, cores, device, lines, worse)
    except KeyboardInterrupt:
        lines.insert(0, "**Interrupted (time limit): the rows below are what was measured.**\n")
    nan_rows = sum(("nan" in line or "inf" in line) for line in lines if line.startswith("| ") and "regime" not in line)
    return lines, nan_rows, worse if not args.smoke else None


def _stress_rows(args, regimes, cores, device, lines, worse):
    from gdn_stress import cpcompile_core, relative_errors, run_core, stress_case

    for lname, layout in stress_layouts(args.smoke).items():
        for i, regime in enumerate(regimes):
            case = stress_case(regime, layout, seed=100 + i, reference_device=device,
                               reference="recurrence" if args.smoke else "chunked")
            errs = {}
            for cname, (backend, dtype) in cores.items():
                core = fla_stress_core(layout) if backend == "fla" else cpcompile_core(backend, layout)
                errs[cname] = relative_errors(run_core(core, case, dtype, device), case)
            cells = [_worst(e) for e in errs.values()]
            verdicts = []
            for name in ("fp32", "bf16"):
                ours, fla = errs[f"ours {name}"], errs.get(f"fla-core {name}")
                over = [q for q in ours if fla is None or not ours[q] <= fla[q]]
                verdicts.append("n/a" if fla is None else ("yes" if not over else "no: " + ", ".join(over)))
                if fla is not None and over:
                    worse.append(f"{lname} {regime} {name}: " + ", ".join(
                        f"{q} {ours[q]:.1e} vs {fla[q]:.1e}" for q in over))
            lines.append(f"| {lname} | {regime} | " + " | ".join(cells) + " | " + " / ".join(verdicts) + " |")
            print(lines[-1], flush=True)


def _worst(errors):
    name = max(errors, key=lambda n: (errors[n] != errors[n], errors[n]))  # NaN first
    return f"{errors[name]:.1e} ({name})"


def main_stress(args):
    lines, nan_rows, worse = stress(args)
    env = (f"torch {torch.__version__}, device {torch.cuda.get_device_name() if not args.smoke else 'cpu'}"
           + (", fla-core 0.6.0 at one config per kernel (FLA_ONE_CONFIG=1: not tuned)"
              if os.environ.get("FLA_ONE_CONFIG") == "1" else ""))
    head = ["# GDN core stability: correlated keys, weak decay", "", f"Environment: {env}. Command: "
            "`python3 benchmarks/gdn_accuracy.py --stress`.", "",
            "Each cell: the worst relative L2 error against the float64 oracle (the eager chunk form in float64 on "
            "the GPU, the token-by-token recurrence with --smoke) over the output, "
            "the final state (not with packed documents) and the gradients of q, k, v, g, beta and the initial "
            "state (with h0), and which one it was. q/k L2-normalised in the op; g and the states fp32. "
            "Regimes: key cosine (0 randn, 0.75 uniform entries) x gate scale (g = scale * logsigmoid(randn)). "
            "Shapes: B=1, 2 key / 4 value heads, K=V=128 (smoke: 1 / 2 heads, 16).",
            "", f"Rows with a NaN or Inf anywhere: {nan_rows}.", ""]
    if worse is None:
        tail = ["", "fla-core not run."]
    else:
        tail = ["", "Quantities where ours exceeds fla-core's error:" if worse else "Ours is at most fla-core's "
                "error in every quantity of every row."] + [f"- {w}" for w in worse]
    if args.smoke:
        print("\n".join(head + lines + tail))
        return
    write_report(head + lines + tail, args.out, "gdn_stability", torch.cuda.get_device_name())


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
    ap.add_argument("--stress", action="store_true", help="every stress regime, ours against fla-core")
    args = ap.parse_args()
    if args.stress:
        return main_stress(args)
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
