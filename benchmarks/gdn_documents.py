"""Packed GDN documents against one unpacked sequence of the same tokens (issue 48 item 4: packed GDN
within 1.1x of the unpacked core at the same tokens).

    python benchmarks/gdn_documents.py [--T 8192 32768 131072] [--docs 2048 8192 256] [--warmup 5] [--repeat 20]
        [--families core_op api layer layer_compiled fla] [--check-T 1024] [--no-check] [--no-lift-fla-guard]
        [--heads 16 32] [--out FILE]                                     (CUDA, bf16; 5+ minutes on a fresh machine)
    TRITON_INTERPRET=1 python benchmarks/gdn_documents.py --smoke        (CPU interpreter, tiny shapes, no timing claim)

Shapes: the GDN layer of trainer_gpu.py's Qwen3.5-shaped 0.57B model (`MODEL`: 16 key and 16 value heads,
K=V=128, hidden 1024, conv kernel 4), one row of T tokens, bf16. Batches: one unpacked sequence (the
reference: no document information at all); the same T tokens as one document handed through the packed
path (what the trainer runs on every batch once data.packing is on); and seeded documents of about 2K, 8K
and, the worst case, 256 tokens (lengths uniform in [mean/2, 3 mean/2], the last cut to fit). Families,
each packed row's ratio taken to its own family's unpacked row:
- `core_op`: `cpcompile::gdn_chunk` (triton) as the trainer's `adapters.qwen3_5.gdn_layer_forward` calls it:
  q/k L2-normalised fp32, v/beta bf16, g fp32, document starts `positions == 0` (the path packed batches take);
- `api`: `cpcompile.kernels.chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True, backend="triton",
  cu_seqlens=)` on bf16 inputs: the public entry point, as fla-core's is called;
- `layer` / `layer_compiled`: the whole GDN layer op the trainer calls (`gdn_layer_forward`: projections, the
  causal conv whose halo stops at document starts, SiLU, q/k L2 norm, gates, core, gated norm, out_proj),
  eagerly and under `torch.compile(dynamic=False)` with inductor (the trainer compiles each decoder layer so
  on CUDA without CP); one compilation per T and batch kind (unpacked or packed);
- `fla`: fla-core's `chunk_gated_delta_rule(..., cu_seqlens=)` when `fla` imports (the peer). Its Hopper guard
  is lifted for timing unless `--no-lift-fla-guard` (fla_guard.py); its gradients are then not trusted.
Times: median of `repeat` after `warmup` (CUDA events); fwd with autograd recording (a training forward);
bwd = (fwd+bwd) - fwd; peak GiB of one fwd+bwd above its inputs (and the layer's parameters). Then every
(family, batch) is checked at `--check-T` tokens (documents cut to a quarter of it, plus odd lengths 1, 3,
63, 64, 65, ...): the family's path in float32 against float64 cpcompile eager run on each document alone
(relative L2 error of the output, and the largest over the gradients of inputs and parameters).
Interrupted (Ctrl-C, `timeout -s INT`), it still writes what it measured.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys

import torch
import torch._dynamo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gdn_documents_cases import CoreApi, CoreOp, Docs, FlaVarlen, Layer, batches, grad_like, shape_of  # noqa: E402
from gdn_kernels import time_cuda, write_report  # noqa: E402
from trainer_gpu import MODEL, SMALL  # noqa: E402

FAMILIES = ("core_op", "api", "layer", "layer_compiled", "fla")
# float32 paths against float64: ~1e-6 on outputs and input gradients (CPU interpreter, T=64..128); a
# document leak (state or conv halo) errs by far more. Parameter gradients are shown, not judged: the
# layer's A_log and dt_bias gradients, sums of T x heads signed terms, lose more (1.5e-4 at T=64).
TOLERANCE = 1e-4
INPUT_NAMES = ("q", "k", "v", "g", "beta", "hidden")
FULL = dict(T=[8192, 32768, 131072], docs=[2048, 8192, 256], check_T=1024)
SMOKE = dict(T=[128], docs=[40], check_T=128)
SMOKE_MODEL = dict(SMALL, linear_num_key_heads=1, linear_num_value_heads=2)  # fewer interpreted programs


def make_families(names: list[str], config: dict, lift_fla_guard: bool) -> tuple[list, list[str]]:
    """-> (family objects, notes on those that cannot run here)."""
    shape, out, notes = shape_of(config), [], []
    for name in names:
        if name == "core_op":
            out.append(CoreOp(shape))
        elif name == "api":
            out.append(CoreApi(shape))
        elif name in ("layer", "layer_compiled"):
            out.append(Layer(shape, config, "inductor" if name == "layer_compiled" else None))
        elif name == "fla":
            try:
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn

                if lift_fla_guard:
                    from fla_guard import lift_fla_hopper_guard

                    lift_fla_hopper_guard()  # timing only: see the module docstring
                out.append(FlaVarlen(shape, fla_fn))
            except Exception as exc:  # noqa: BLE001 - the peer is optional
                notes.append(f"fla-core not run: {type(exc).__name__}: {exc}"[:200])
    return out, notes


# ----------------------------------------------------------------------------- timing


def _clear(leaves: dict) -> None:
    for x in leaves.values():
        x.grad = None


def peak_above_inputs(step) -> float:
    """Peak GiB allocated by one call of `step` above what was allocated before it (nan on CPU)."""
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def measure(family, T: int, docs: Docs, device, warmup: int, repeat: int) -> dict:
    leaves, run = family.case(T, docs, device)
    grad = []  # the output gradient, drawn at the first call (a warm-up one on CUDA)

    def both():
        _clear(leaves)
        out = run()
        grad[:] = grad or [grad_like(out)]
        out.backward(grad[0])
    fb = time_cuda(both, warmup, repeat)
    fwd = time_cuda(run, warmup, repeat)
    _clear(leaves)
    peak = peak_above_inputs(both)
    _clear(leaves)
    return dict(fwd=fwd, bwd=fb - fwd, fb=fb, peak=peak, documents=len(docs.lengths) if docs.packed else 1)


def timing_rows(families, args, device, lines: list[str]) -> None:
    """One table row per (T, family, batch), in order, appended to `lines` as they come."""
    shape = families[0].shape
    for T in args.T:
        for family in families:
            reference = None
            for docs in batches(T, args.docs):
                head = (f"| {family.name} | {docs.name} | (1,{T},{shape.hk},{shape.hv},{shape.dk},{shape.dv}) "
                        f"| {args.warmup}/{args.repeat} |")
                try:
                    r = measure(family, T, docs, device, args.warmup, args.repeat)
                except Exception as exc:  # noqa: BLE001 - a path that fails is a row
                    emit(lines, f"{head} {type(exc).__name__}: {str(exc).splitlines()[0][:150]} | | | | | | |")
                    continue
                reference = reference or (r if not docs.packed else None)
                ratio = [f"{r[k] / reference[k]:.2f}" if reference and docs.packed else "-" for k in ("fwd", "fb")]
                emit(lines, f"{head} {r['documents']} | {r['fwd']:.3f} | {r['bwd']:.3f} | {r['fb']:.3f} "
                            f"| {r['peak']:.2f} | {ratio[0]} | {ratio[1]} |")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- correctness


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    b = b.double()
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def check_errors(family, T: int, docs: Docs, device) -> tuple[float, str, str]:
    """Relative L2 errors of the family's path in float32 against float64 cpcompile eager run on each
    document alone -> (output, the largest input gradient's, the largest parameter gradient's), each
    gradient's naming its leaf."""
    results = []
    for leaves, run in (family.case(T, docs, device, torch.float32), family.reference(T, docs, device)):
        _clear(leaves)
        out = run()
        out.backward(grad_like(out.float()).to(out.dtype))
        results.append((out.detach(), {name: x.grad for name, x in leaves.items()}))
        _clear(leaves)
    (out, grads), (want, want_grads) = results
    errs = {name: _rel(grads[name], b) for name, b in want_grads.items() if b is not None and b.norm() > 0}
    inputs = {name: e for name, e in errs.items() if name in INPUT_NAMES}
    params = {name: e for name, e in errs.items() if name not in INPUT_NAMES}
    return _rel(out, want), _worst(inputs), _worst(params)


def _worst(errs: dict[str, float]) -> str:
    if not errs:
        return "-"
    name = max(errs, key=errs.get)
    return f"{errs[name]:.1e} ({name})"


def check_rows(families, args, device, lines: list[str]) -> None:
    lines += ["", f"Correctness at T={args.check_T}: each path in float32 against float64 cpcompile eager run on "
              "each document alone (relative L2 error; gradients: the largest of the inputs' and of the parameters', "
              "leaf named):", "",
              "| family | batch | documents | rel err out | rel err input grads | rel err parameter grads | out and "
              f"input grads within {TOLERANCE:g} |", "|---|---|---|---|---|---|---|"]
    for family in families:
        for docs in batches(args.check_T, args.docs, check=True):
            n = len(docs.lengths) if docs.packed else 1
            try:
                out, inputs, params = check_errors(family, args.check_T, docs, device)
            except Exception as exc:  # noqa: BLE001 - a check that fails to run is a row
                emit(lines, f"| {family.name} | {docs.name} | {n} | {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:150]} | | | no |")
                continue
            ok = "yes" if max(out, float(inputs.split()[0])) < TOLERANCE else "no"
            emit(lines, f"| {family.name} | {docs.name} | {n} | {out:.1e} | {inputs} | {params} | {ok} |")


def emit(lines: list[str], line: str) -> None:
    lines.append(line)
    print(line, flush=True)


# ----------------------------------------------------------------------------- main


def environment(device) -> str:
    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    return f"torch {torch.__version__}, triton {triton.__version__}, device {name}"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", help="tokens in the row (default 8192 32768 131072)")
    ap.add_argument("--docs", type=int, nargs="+", help="mean document lengths (default 2048 8192 256)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--check-T", type=int, help="tokens of the correctness checks (default 1024)")
    ap.add_argument("--heads", type=int, nargs=2, metavar=("HK", "HV"),
                    help="key and value heads instead of the 0.57B model's 16 and 16 (gdn_kernels.py times 16 and 32)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    ap.add_argument("--no-lift-fla-guard", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, trainer_gpu.SMALL's GDN layer with 1/2 "
                    f"heads, by default {SMOKE}, no compiled layer: checks the code paths only")
    ap.add_argument("--out", default=None, help="write the tables here (default on CUDA: benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
        args.warmup, args.repeat = 0, 1
        args.families = [f for f in args.families if f != "layer_compiled"]
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gdn_documents: needs CUDA (or --smoke on the CPU interpreter); nothing measured", file=sys.stderr)
        return 1
    device = torch.device("cpu" if args.smoke else "cuda")
    config = SMOKE_MODEL if args.smoke else MODEL
    if args.heads:
        config = dict(config, linear_num_key_heads=args.heads[0], linear_num_value_heads=args.heads[1])
    families, notes = make_families(args.families, config, not args.no_lift_fla_guard)
    env = environment(device)
    print(env, *notes, sep="\n", flush=True)
    if not families:
        print("gdn_documents: none of the families asked for runs here; nothing measured", file=sys.stderr)
        return 1
    shape = shape_of(config)
    command = " ".join(["python benchmarks/gdn_documents.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [f"# Packed GDN documents vs one unpacked sequence — {_dt.date.today().isoformat()}", "",
             f"Environment: {env}.", "", f"Command: `{command}`", "",
             *[f"- {n}" for n in notes], *([""] if notes else []),
             f"Shapes: B=1, key heads {shape.hk}, value heads {shape.hv}, K={shape.dk}, V={shape.dv}, hidden "
             f"{shape.hidden}, conv kernel {shape.conv}; bf16 (the core op's q/k fp32, as the layer hands them "
             "over). Ratios: packed / the same family's unpacked row at the same T (target <= 1.1). "
             "bwd = (fwd+bwd) - fwd; peak: one fwd+bwd above its inputs.", "",
             "| method | batch | shapes (B,T,Hk,Hv,K,V) | warmup/repeat | documents | fwd ms | bwd ms | fwd+bwd ms "
             "| peak GiB | packed / unpacked fwd | packed / unpacked fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    try:  # a compilation per (T, unpacked or packed) of the compiled layer: keep them all
        with torch._dynamo.config.patch(cache_size_limit=64):
            timing_rows(families, args, device, lines)
            if not args.no_check:
                check_rows(families, args, device, lines)
    except KeyboardInterrupt:
        lines += ["", "**Interrupted: the tables hold what was measured before.**"]
    if args.smoke and not args.out:
        print("\n".join(lines))
        return 0
    write_report(lines, args.out, "gdn_documents", torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
