"""Benchmark the GDN core: cpcompile's Triton kernels vs fla-core vs transformers' torch reference.

    python benchmarks/gdn_kernels.py [--T 8192 16384 32768 65536] [--warmup 5] [--repeat 20] [--out FILE]
    python benchmarks/gdn_kernels.py --p2p-variants [--T 16384 32768 65536] [--hs 1 2 4] [--obv 64 128] ...
    python benchmarks/gdn_kernels.py --tune ...   # first sweep warps/stages/column blocks per kernel at 16K
    TRITON_INTERPRET=1 python benchmarks/gdn_kernels.py [--p2p-variants] --smoke   # CPU, tiny shape, no timing claim

Shapes follow Qwen3.5's GDN layer: B=1, 16 key heads, 32 value heads, K=V=128, bf16 q/k/v/beta,
fp32 g, q/k L2-normalised in the op. For each T it reports forward, forward+backward (median of
``repeat`` timed iterations after ``warmup``, CUDA events) and peak allocated/reserved memory of one
forward+backward; plus the State-P2P local cost (summary + output-with-state) against the plain local
forward; the GDN CP wrappers' triton backend as the rewritten graph calls it (plain core
``cpcompile::gdn_chunk`` vs a middle rank's State-P2P executor, ``cpcompile::gdn_p2p_chunk``, whose
messages complete at once); and a per-kernel breakdown at 16K (``--no-breakdown`` skips it).
``--p2p-variants`` instead times only the plain forward against every State-P2P forward variant, and
the plain backward against every variant of the backward summary (see ``bench_p2p_variants``); it
needs no fla-core. Interrupted (Ctrl-C, ``timeout -s INT``), it still
writes what it measured.
On a fresh machine fla-core's first call compiles and autotunes for minutes: give a full run 5+ minutes.

fla-core's gated backward refuses to run on Hopper with Triton < 3.7.1 (fla issue #640, a Triton
miscompile). For *timing only* this script lifts that guard by default; fla's gradients are then not
trusted, and are not used for any correctness claim. ``--no-lift-fla-guard`` leaves it alone: on
Triton >= 3.7.1 fla-core runs that backward by itself
(results/gdn_kernels_2026-12-01_NVIDIA-H200_triton-3.7.1.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib
import math
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

B, HK, HV, DK, DV = 1, 16, 32, 128, 128



def _l2norm(x):
    """q/k normalisation in eager PyTorch (fp32, back to the input dtype), for timing pieces."""
    from cpcompile.kernels.gdn import l2norm

    return l2norm(x.float()).to(x.dtype)

def make_inputs(T, *, seed=0, requires_grad=False, dtype=torch.bfloat16, dims=None, device="cuda"):
    """``dims`` = (B, Hk, Hv, K, V), default the Qwen3.5 shape above."""
    b, hk, hv, dk, dv = dims or (B, HK, HV, DK, DV)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)
    q = rnd(b, T, hk, dk).to(dtype)
    k = rnd(b, T, hk, dk).to(dtype)
    v = rnd(b, T, hv, dv).to(dtype)
    g = torch.nn.functional.logsigmoid(rnd(b, T, hv) + 2.0)
    beta = torch.sigmoid(rnd(b, T, hv)).to(dtype)
    xs = [q, k, v, g, beta]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
    do = rnd(b, T, hv, dv).to(dtype)
    return xs, do


def time_cuda(fn, warmup, repeat):
    if not torch.cuda.is_available():  # --smoke under the CPU interpreter: run once, wall clock
        import time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_memory(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30


# ----------------------------------------------------------------------------- the methods


def ours():
    from cpcompile.kernels import chunk_gated_delta_rule

    def run(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend="triton")[0]
    return run


def fla_method(lift_guard=True):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from fla_guard import lift_fla_hopper_guard

    if lift_guard:
        lift_fla_hopper_guard()  # timing only: see module docstring

    def run(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    return run


def torch_reference():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    fn = getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", m.torch_chunk_gated_delta_rule)
    if not fn.__module__.startswith("transformers"):
        raise RuntimeError(f"transformers' torch reference resolved to {fn.__module__}")

    def run(q, k, v, g, beta):
        # older transformers releases need q/k already expanded to the value heads
        rep = v.shape[2] // q.shape[2]
        return fn(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta,
                  use_qk_l2norm_in_kernel=True)[0]
    return run


def bench_method(name, backend, run, T, warmup, repeat, rows, *, bwd=True):
    xs, do = make_inputs(T)
    fwd_ms = time_cuda(lambda: run(*xs), warmup, repeat)
    fb_ms, alloc, reserved = float("nan"), float("nan"), float("nan")
    if bwd:
        xg, _ = make_inputs(T, requires_grad=True)

        def step():
            for x in xg:
                x.grad = None
            run(*xg).backward(do)
        fb_ms = time_cuda(step, warmup, repeat)
        alloc, reserved = peak_memory(step)
    rows.append(dict(method=name, backend=backend, T=T, fwd=fwd_ms, fb=fb_ms, alloc=alloc, reserved=reserved,
                     warmup=warmup, repeat=repeat))
    print(f"  {name:10s} T={T:6d} fwd {fwd_ms:8.3f} ms  fwd+bwd {fb_ms:8.3f} ms  peak {alloc:.2f}/{reserved:.2f} GiB",
          flush=True)


def bench_p2p(T, warmup, repeat, rows, with_fla=False):
    from cpcompile.kernels.gdn.summary import chain_grad_step, chain_step
    from cpcompile.kernels.gdn.triton import launch as L

    (q, k, v, g, beta), do = make_inputs(T)
    q, k = _l2norm(q), _l2norm(k)
    h_in = torch.randn(B, HV, DK, DV, device="cuda") * 0.1
    scale = DK ** -0.5

    def plain():
        return L.gdn_fwd(q, k, v, g, beta, h_in, scale)[:2]

    def p2p():
        M, S, saved = L.p2p_fwd_summary(k, v, g, beta)
        h_out = chain_step(M, S, h_in)
        return L.p2p_fwd_output(q, k, saved, h_in, scale), h_out

    o_ref, h_ref = plain()
    o_p2p, h_p2p = p2p()
    err = max(_rel(o_p2p, o_ref), _rel(h_p2p, h_ref))
    t_plain = time_cuda(plain, warmup, repeat)
    t_p2p = time_cuda(p2p, warmup, repeat)
    M, S, saved = L.p2p_fwd_summary(k, v, g, beta)
    t_sum = time_cuda(lambda: L.p2p_fwd_summary(k, v, g, beta), warmup, repeat)
    t_out = time_cuda(lambda: L.p2p_fwd_output(q, k, saved, h_in, scale), warmup, repeat)

    # backward: plain local backward vs P2P bwd summary + finish
    o, ht, gc, w, u, tinv = L.gdn_fwd(q, k, v, g, beta, h_in, scale)
    dht = torch.randn_like(ht)
    t_bplain = time_cuda(lambda: L.gdn_bwd(q, k, v, g, beta, h_in, gc, w, u, tinv, do, dht, scale), warmup, repeat)

    def p2p_bwd():  # as a middle rank runs it
        dl, mt, dvl = L.p2p_bwd_summary(q, k, w, gc, do, scale)
        dh_in = chain_grad_step(mt.transpose(-1, -2), dl, dht)
        return L.p2p_bwd_finish(q, k, v, g, beta, gc, w, u, tinv, do, h_in, {"dvl": dvl}, dht, scale), dh_in
    t_bp2p = time_cuda(p2p_bwd, warmup, repeat)
    ref_g = L.gdn_bwd(q, k, v, g, beta, h_in, gc, w, u, tinv, do, dht, scale)
    got_g, got_dh = p2p_bwd()
    gerr = max(_rel(a, b) for a, b in zip([*got_g, got_dh], ref_g))
    fla_cp = None
    if with_fla:
        dl, mt, dvl = L.p2p_bwd_summary(q, k, w, gc, do, scale)
        fla_cp = fla_cp_summaries(q, k, w, u, gc, do, dvl, scale, (M, S, dl, mt), warmup, repeat)
    rows.append(dict(T=T, plain=t_plain, p2p=t_p2p, summary=t_sum, output=t_out, err=err,
                     bplain=t_bplain, bp2p=t_bp2p, gerr=gerr, fla_cp=fla_cp))
    print(f"  P2P T={T}: plain fwd {t_plain:.3f} ms, summary {t_sum:.3f} + output {t_out:.3f} "
          f"(together {t_p2p:.3f} ms, {t_p2p / t_plain:.2f}x); bwd plain {t_bplain:.3f} vs p2p {t_bp2p:.3f} ms "
          f"({t_bp2p / t_bplain:.2f}x); |o_p2p-o|/|o| {err:.1e}, grads {gerr:.1e}", flush=True)


def fla_cp_summaries(q, k, w, u, gc, do, dvl, scale, ours, warmup=5, repeat=20):
    """fla-core's context-parallel summaries (its KCP pre-process kernels, ``fla.ops.cp``) on our
    prepared tensors: the work a middle rank of fla's CP adds to its plain forward (``chunk_cp_fwd_h``:
    ``[S | M]``) and backward (``chunk_cp_bwd_dh``: ``[dH_local | M^T]``), before the all-gather and merge.
    -> dict(fwd, bwd ms, err: relative differences of their summaries from ours ``(M, S, dl, mt)``)
    or None where fla-core has no ``fla.ops.cp``. B = 1 (their summary covers one sequence)."""
    try:
        from fla.ops.cp.chunk_bwd import chunk_cp_bwd_dh
        from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
    except ImportError:
        return None
    M, S, dl, mt = (x[0] for x in ours)
    hv, kd, vd = S.shape
    g2 = gc / math.log(2)  # fla's kernels take the gates in log2
    hm = torch.zeros(hv, kd, vd + kd, device=q.device, dtype=torch.float32)
    dhm = torch.zeros_like(hm)

    def fwd():
        chunk_cp_fwd_h(k=k, w=w, u=u, hm=hm, g=g2)

    def bwd():
        chunk_cp_bwd_dh(q=q, k=k, w=w, do=do, dv=dvl, dhm=dhm, g=g2, scale=scale)
    fwd(), bwd()
    err = ", ".join(f"{name} {_diff(a, b)}" for name, a, b in (("S", hm[..., :vd], S), ("M", hm[..., vd:], M),
                                                                ("dH_local", dhm[..., :vd], dl), ("M^T", dhm[..., vd:], mt)))
    out = dict(fwd=time_cuda(fwd, warmup, repeat), bwd=time_cuda(bwd, warmup, repeat), err=err)
    print(f"  fla-core CP summaries: fwd {out['fwd']:.3f} ms, bwd {out['bwd']:.3f} ms; vs ours: {err}", flush=True)
    return out


# ----------------------------------------------------------------------------- State-P2P variants

def _stage(name: str):
    """The module of ``cpcompile/kernels/gdn/triton/`` holding a tunable: ``launching`` (the per-kernel
    NUM_WARPS / NUM_STAGES / STATE_BV tables, FIT_STAGES) or a stage file (its own constants)."""
    return importlib.import_module(f"cpcompile.kernels.gdn.triton.{name}")


# variant keys -> launch tunables: a stage file's constant (``_SCALAR_KNOBS``: module, name) or an entry
# of launching's NUM_WARPS / NUM_STAGES / STATE_BV (``_DICT_KNOBS``: table, kernel key)
_SCALAR_KNOBS = {"hs": ("p2p_output", "P2P_HSTRIDE"), "obv": ("p2p_output", "P2P_OUTPUT_BV"),
                 "plain_obv": ("output", "OUTPUT_BV")}
_DICT_KNOBS = {"ow": ("NUM_WARPS", "p2p_output"), "ost": ("NUM_STAGES", "p2p_output"),
               "sbv": ("STATE_BV", "p2p_summary"), "sw": ("NUM_WARPS", "p2p_summary"), "sst": ("NUM_STAGES", "p2p_summary"),
               "plain_ow": ("NUM_WARPS", "output"), "bbv": ("STATE_BV", "bwd_state_aug"),
               "bw": ("NUM_WARPS", "bwd_state_aug"), "bst": ("NUM_STAGES", "bwd_state_aug")}
P2P_GRID = {"hs": [0, 16, 32, 64, 128, 256], "sbv": [32, 64], "sw": [4, 8], "sst": [3, 4], "obv": [64, 128], "ow": [4, 8],
            "ost": [1], "plain_obv": [64, 128], "plain_ow": [4], "bbv": [64], "bw": [4], "bst": [3]}


def _set(**kw):
    """Set launch tunables by variant key; -> the previous values (restore with ``_set(**old)``)."""
    old = {}
    for key, val in kw.items():
        if key in _DICT_KNOBS:
            table, entry = _DICT_KNOBS[key]
            old[key] = getattr(_stage("launching"), table)[entry]
            getattr(_stage("launching"), table)[entry] = val
        else:
            module, name = _SCALAR_KNOBS[key]
            old[key] = getattr(_stage(module), name)
            # hs 0 (or a restored None) is p2p_output.p2p_hstride's own pick per call
            setattr(_stage(module), name, None if key == "hs" and not val else val)
    return old


def _p2p_defaults():
    T, P, O = _stage("launching"), _stage("p2p_output"), _stage("output")
    return dict(hs=P.P2P_HSTRIDE or 0, sbv=T.STATE_BV["p2p_summary"], sw=T.NUM_WARPS["p2p_summary"],
                sst=T.NUM_STAGES["p2p_summary"], obv=P.P2P_OUTPUT_BV,
                ow=T.NUM_WARPS["p2p_output"], ost=T.NUM_STAGES["p2p_output"], plain_obv=O.OUTPUT_BV,
                plain_ow=T.NUM_WARPS["output"])


def _diff(a, b) -> str:
    """Relative L2 difference, or where ``b`` is zero (a transition decayed below fp32) the largest |a|."""
    return f"{_rel(a, b):.1e}" if b.float().norm() > 0 else f"max |x| {a.float().abs().max().item():.1e} (ours 0)"


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _configs(grid, keys):
    import itertools

    return [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))]


@contextlib.contextmanager
def _exact_stages():
    """Sweeps time the pipeline depth they name: a depth this GPU cannot build fails instead of
    running at a shallower one (``launching.FIT_STAGES``)."""
    launching = _stage("launching")
    old, launching.FIT_STAGES = launching.FIT_STAGES, False
    try:
        yield
    finally:
        launching.FIT_STAGES = old


def _timed(cfg, fn, warmup, repeat):
    """Median ms of ``fn`` under the launch tunables ``cfg`` (restored after) -> (ms, None) or (inf, error)."""
    old = _set(**cfg)
    try:
        with _exact_stages():
            return time_cuda(fn, warmup, repeat), None
    except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory on this GPU)
        return float("inf"), f"failed {exc!r:.80}"
    finally:
        _set(**old)


_SUMMARY_KEYS, _OUTPUT_KEYS = ("sbv", "sw", "sst"), ("obv", "ow", "ost")
_BWD_SUMMARY_KEYS = ("bbv", "bw", "bst")


def bench_p2p_variants(Ts, warmup, repeat, grid=None, dims=None, device="cuda"):
    """Plain local forward (``launch.gdn_fwd``) vs every State-P2P forward variant (``p2p_fwd_summary``
    + ``p2p_fwd_output``) from the same incoming state. Summaries are timed per hs x _SUMMARY_KEYS,
    outputs per hs x _OUTPUT_KEYS; each output row is paired with the fastest summary of its hs. A
    variant that fails to build (e.g. out of shared memory) is reported, not fatal; a device fault
    (illegal address) poisons the CUDA context, so every later row fails too. Then the backward
    summary per _BWD_SUMMARY_KEYS (``_bwd_summary_rows``). -> markdown lines."""
    from cpcompile.kernels.gdn.triton import launch as L

    grid = {**P2P_GRID, **(grid or {})}
    base = _p2p_defaults()
    b, _, hv, dk, dv = dims or (B, HK, HV, DK, DV)
    lines = ["| variant | T | summary ms | output ms | total ms | ratio to plain fwd | rel err o vs plain |",
             "|---|---|---|---|---|---|---|"]
    for T in Ts:
        (q, k, v, g, beta), _ = make_inputs(T, dims=dims, device=device)
        q, k = _l2norm(q), _l2norm(k)
        h_in = torch.randn(b, hv, dk, dv, device=device) * 0.1
        scale = dk ** -0.5
        o_ref = L.gdn_fwd(q, k, v, g, beta, h_in, scale)[0]
        t_plain = time_cuda(lambda: L.gdn_fwd(q, k, v, g, beta, h_in, scale), warmup, repeat)
        rows = []
        for cfg in _configs(grid, ("plain_obv", "plain_ow")):
            t, err = _timed(cfg, lambda: L.gdn_fwd(q, k, v, g, beta, h_in, scale), warmup, repeat)
            rows.append((t, f"plain fwd, output bv={cfg['plain_obv']} w={cfg['plain_ow']} {err or ''}", "-", "-",
                         f"{t / t_plain:.2f}", "-"))
        for hs in grid["hs"]:
            sums = [(*_timed({"hs": hs, **c}, lambda: L.p2p_fwd_summary(k, v, g, beta), warmup, repeat), c)
                    for c in _configs(grid, _SUMMARY_KEYS)]
            for t, err, c in sums:
                print(f"  T={T} summary hs={hs} {c}: {err or f'{t:.3f} ms'}", flush=True)
            t_sum, _, c_sum = min(sums, key=lambda x: x[0])
            if t_sum == float("inf"):
                continue
            old = _set(hs=hs)
            saved = L.p2p_fwd_summary(k, v, g, beta)[2]
            _set(**old)
            for c in _configs(grid, _OUTPUT_KEYS):
                cfg = {"hs": hs, **c_sum, **c}
                name = " ".join(f"{a}={x}" for a, x in cfg.items())
                name += " (default)" if all(base[a] == x for a, x in cfg.items()) else ""
                fn = lambda: L.p2p_fwd_output(q, k, saved, h_in, scale)  # noqa: E731
                t, err = _timed({"hs": hs, **c}, fn, warmup, repeat)
                old = _set(hs=hs, **c)
                rel = f"{_rel(fn(), o_ref):.1e}" if err is None else "-"
                _set(**old)
                tot = t_sum + t
                rows.append((tot, f"{name} {err or ''}", f"{t_sum:.3f}", f"{t:.3f}", f"{tot / t_plain:.2f}", rel))
        rows = sorted(rows, key=lambda r: r[0])
        rows += _bwd_summary_rows(L, T, q, k, v, g, beta, h_in, scale, grid, warmup, repeat)
        lines.append(f"| plain fwd (launch.gdn_fwd, defaults) | {T} | - | - | {t_plain:.3f} | 1.00 | - |")
        for tot, name, ts, to, ratio, rel in rows:
            lines.append(f"| {name.strip()} | {T} | {ts} | {to} | {tot:.3f} | {ratio} | {rel} |")
        print("\n".join(lines[-len(rows) - 1:]), flush=True)
    return lines


def _bwd_summary_rows(L, T, q, k, v, g, beta, h_in, scale, grid, warmup, repeat):
    """The backward summary (``p2p_bwd_summary``) per variant of its augmented reverse pass, as rows
    of the variants table: its time is what State-P2P's backward adds to a plain one."""
    _, _, gc, w, u, tinv = L.gdn_fwd(q, k, v, g, beta, h_in, scale)
    do = torch.randn_like(v)
    ref = L.p2p_bwd_summary(q, k, w, gc, do, scale)
    t_bwd = time_cuda(lambda: L.gdn_bwd(q, k, v, g, beta, h_in, gc, w, u, tinv, do, None, scale), warmup, repeat)
    rows = [(t_bwd, "plain bwd (launch.gdn_bwd, defaults)", "-", "-", "1.00 (bwd)", "-")]
    for c in _configs(grid, _BWD_SUMMARY_KEYS):
        t, err = _timed(c, lambda: L.p2p_bwd_summary(q, k, w, gc, do, scale), warmup, repeat)
        rel = "-"
        if err is None:
            old = _set(**c)
            got = L.p2p_bwd_summary(q, k, w, gc, do, scale)
            _set(**old)
            rel = f"{max(_rel(a, b) for a, b in zip(got[:2], ref)):.1e}"
        name = "bwd summary " + " ".join(f"{a}={x}" for a, x in c.items())
        print(f"  T={T} {name}: {err or f'{t:.3f} ms'} (plain bwd {t_bwd:.3f} ms)", flush=True)
        # the finish is a plain backward that reuses the summary's dvl: an upper estimate
        rows.append((t, f"{name} {err or ''}", f"{t:.3f}", "-", f"<= {(t + t_bwd) / t_bwd:.2f} (bwd)", rel))
    rows[1:] = sorted(rows[1:], key=lambda r: r[0])
    return rows


class MiddleRank:
    """The ring as a middle rank of the State-P2P executor sees it, without a second device: every
    receive returns a fixed state (or state gradient) at once, every send completes at once."""

    class Done:
        def wait(self):
            pass

    rank, world = 1, 3

    def __init__(self, state):
        self.state = state

    def post_recv(self, like, offset):
        return self.state, self.Done()

    def send(self, tensor, offset):
        return self.Done()


def bench_layer_ops(T, warmup, repeat, rows):
    """The GDN CP wrappers' triton backend as the rewritten graph calls it (q/k fp32 as Qwen3.5's layer
    hands them over, v/beta bf16): the plain local core ``cpcompile::gdn_chunk`` (Ulysses' core, CP=1)
    vs a middle rank's State-P2P executor (``cpcompile::gdn_p2p_chunk``: summary, ``M H + S``, output;
    backward: state-gradient summary, ``dH_local + M^T dH_out``, finish), communication excluded."""
    from cpcompile.kernels.gdn import CHUNK_SIZE as C
    from cpcompile.kernels.gdn import layer_ops  # noqa: F401  (registers the layer-level ops)
    from cpcompile.kernels.gdn.triton.p2p_executor import p2p_backward, p2p_forward

    (q, k, v, g, beta), do = make_inputs(T)
    q, k = (torch.nn.functional.normalize(x.float(), dim=-1) for x in (q, k))
    ring = MiddleRank(torch.randn(B, HV, DK, DV, device="cuda") * 0.1)
    s = DK ** -0.5
    xs = [q, k, v, g, beta]

    def plain():
        return torch.ops.cpcompile.gdn_chunk(*xs, None, s, C, "triton")

    def plain_fwd_bwd():
        leaves = [x.detach().requires_grad_() for x in xs]
        torch.ops.cpcompile.gdn_chunk(*leaves, None, s, C, "triton").backward(do)

    def p2p():
        return p2p_forward(*xs, s, C, ring)

    def p2p_fwd_bwd():
        _, h_in = p2p_forward(*xs, s, C, ring)
        return p2p_backward(do, *xs, h_in, s, C, ring)

    with torch.no_grad():
        t_plain, t_p2p = time_cuda(plain, warmup, repeat), time_cuda(p2p, warmup, repeat)
        tb_p2p = time_cuda(p2p_fwd_bwd, warmup, repeat)
    tb_plain = time_cuda(plain_fwd_bwd, warmup, repeat)
    rows.append(dict(T=T, plain=t_plain, p2p=t_p2p, bplain=tb_plain, bp2p=tb_p2p))
    print(f"  layer ops T={T}: gdn_chunk fwd {t_plain:.3f} ms, P2P executor {t_p2p:.3f} ms ({t_p2p / t_plain:.2f}x); "
          f"fwd+bwd {tb_plain:.3f} vs {tb_p2p:.3f} ms ({tb_p2p / tb_plain:.2f}x)", flush=True)


def accuracy(T, methods):
    """Relative L2 error of o and of every input gradient vs the fp32 eager oracle, same bf16 inputs."""
    from cpcompile.kernels.gdn.eager import chunk_gated_delta_rule_eager

    xs, do = make_inputs(T, seed=1)
    ref_in = [x.detach().float().requires_grad_() for x in xs]
    ro = chunk_gated_delta_rule_eager(*ref_in, use_qk_l2norm_in_kernel=True)[0]
    ro.backward(do.float())
    out = []
    for name, _, run in methods:
        xin = [x.detach().clone().requires_grad_() for x in xs]
        try:
            o = run(*xin)
            o.backward(do)
        except Exception as exc:  # noqa: BLE001
            out.append((name, repr(exc)))
            continue
        errs = [("o", o, ro)] + [(f"d{n}", a.grad, b.grad) for n, a, b in zip(["q", "k", "v", "g", "beta"], xin, ref_in)]
        out.append((name, ", ".join(f"{n} {((a.float() - b.float()).norm() / b.float().norm()).item():.1e}"
                                   for n, a, b in errs)))
        print(f"  accuracy {name} T={T}: {out[-1][1]}", flush=True)
    return out


def kernel_breakdown(T, warmup, repeat):
    """ms of one launch of each kernel (keys of ``launching.NUM_WARPS``) at T."""
    return {name: time_cuda(fn, warmup, repeat) for name, fn in _kernel_calls(T).items()}


def profile_kernels(T, methods, repeat=5):
    """Per-kernel GPU time of one forward+backward (torch profiler, CUDA activity, mean of ``repeat``
    steps after 3 warm-ups) -> {method: [(kernel, ms per step, launches per step), ...] slowest first}."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, _, run in methods:
        xg, do = make_inputs(T, requires_grad=True)

        def step():
            for x in xg:
                x.grad = None
            run(*xg).backward(do)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeat):
                step()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", 0) or 0
            if t > 0:
                rows.append((e.key, t / 1e3 / repeat, e.count / repeat))
        out[name] = sorted(rows, key=lambda r: -r[1])
        print(f"  profile {name} T={T}: " + ", ".join(f"{k[:40]} {ms:.3f}" for k, ms, _ in out[name][:8]), flush=True)
    return out


def profile_lines(T, prof, top=16):
    lines = []
    for name, rows in prof.items():
        total = sum(ms for _, ms, _ in rows)
        lines += ["", f"Kernels of one forward+backward, {name}, T={T} (torch profiler; GPU time {total:.3f} ms "
                  "per step, slowest first):", "", "| kernel | launches/step | ms/step |", "|---|---|---|"]
        lines += [f"| `{k[:90]}` | {n:g} | {ms:.3f} |" for k, ms, n in rows[:top]]
        if len(rows) > top:
            lines.append(f"| {len(rows) - top} others | | {sum(ms for _, ms, _ in rows[top:]):.3f} |")
    return lines


def api_overhead(T, warmup, repeat):
    """Where the API forward's time goes: q/k L2 norm, the custom op, the bare launches."""
    from cpcompile.kernels import chunk_gated_delta_rule
    from cpcompile.kernels.gdn.triton import launch as L

    (q, k, v, g, beta), _ = make_inputs(T)
    qn, kn = _l2norm(q), _l2norm(k)
    s = DK ** -0.5
    return {
        "api forward (l2norm + op)": time_cuda(lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), warmup, repeat),
        "eager-PyTorch l2norm of q and k": time_cuda(lambda: (_l2norm(q), _l2norm(k)), warmup, repeat),
        "Triton l2norm (launch.l2norm_fwd) of q and k": time_cuda(
            lambda: (L.l2norm_fwd(q), L.l2norm_fwd(k)), warmup, repeat),
        "torch.ops.cpcompile.gdn_chunk_fwd, q/k normalised inside": time_cuda(
            lambda: torch.ops.cpcompile.gdn_chunk_fwd(q, k, v, g, beta, None, s, True), warmup, repeat),
        "launch.gdn_fwd (bare kernels)": time_cuda(lambda: L.gdn_fwd(qn, kn, v, g, beta, None, s), warmup, repeat),
    }


def ablation(T, warmup, repeat):
    """Time variants that leave a stage out (results are wrong on purpose; timing only)."""
    from cpcompile.kernels.gdn.triton import launch as L
    from cpcompile.kernels.gdn.triton import launching, prepare

    (q, k, v, g, beta), do = make_inputs(T)
    k = _l2norm(k)
    B_, T_, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    NT = (T_ + 63) // 64
    gc, w, u, tinv = L.fwd_prepare(k, v, g, beta)
    out = {}
    for block in (1, 8, 16, 32, 64):  # the chunk inverse: diagonal blocks by substitution, then blocked steps (1: doubling)
        out[f"fwd_prepare, inverse block {block}"] = time_cuda(lambda: prepare.gdn_fwd_prepare_kernel[(NT, B_ * Hv)](
            k, v, g, beta, gc, w, u, tinv, T_, Hk=Hk, Hv=Hv, K=K, V=V, BT=64, BS=block, STORE_TINV=True,
            num_warps=launching.NUM_WARPS["prepare"], **launching.flags(k.dtype)), warmup, repeat)
    out["torch copy of w,u,tinv (memory floor proxy)"] = time_cuda(lambda: (w.clone(), u.clone(), tinv.clone()), warmup, repeat)
    return out


def _kernel_calls(T, dims=None, device="cuda"):
    """One launch per kernel key (``launching.NUM_WARPS``'s keys) at T; ``dims`` = (B, Hk, Hv, K, V),
    default the bench shapes."""
    from cpcompile.kernels.gdn.triton import launch as L

    b, _, hv, dk, dv = dims or (B, HK, HV, DK, DV)
    (q, k, v, g, beta), do = make_inputs(T, dims=dims, device=device)
    q, k = _l2norm(q), _l2norm(k)
    s = dk ** -0.5
    gc, w, u, tinv = L.fwd_prepare(k, v, g, beta)
    hbuf, vnbuf, _ = L.fwd_state(k, w, u, gc, None)
    dvl = L.bwd_dv_local(q, k, gc, do, s)
    dhbuf, dvnbuf, _ = L.bwd_state(q, k, w, gc, do, dvl, None, s)
    dqv, dkv, dw, dgc = L.bwd_inter(q, k, w, u, gc, do, hbuf, dhbuf, dvnbuf, s)
    summary_hbuf, summary_ht, gbuf = L.p2p_summary_pass(k, w, u, gc)
    L.p2p_chain(gbuf, summary_hbuf, summary_ht)
    h_in = torch.randn(b, hv, dk, dv, device=device) * 0.1
    return {
        "prepare": lambda: L.fwd_prepare(k, v, g, beta),
        "state": lambda: L.fwd_state(k, w, u, gc, None),
        "p2p_summary": lambda: L.p2p_summary_pass(k, w, u, gc),
        "p2p_chain": lambda: L.p2p_chain(gbuf, summary_hbuf, summary_ht),  # in place: same work each call
        "output": lambda: L.fwd_output(q, k, gc, hbuf, vnbuf, s),
        "p2p_output": lambda: L.p2p_output(q, k, w, u, gc, summary_hbuf, h_in, s),
        "dv_local": lambda: L.bwd_dv_local(q, k, gc, do, s),
        "bwd_state": lambda: L.bwd_state(q, k, w, gc, do, dvl, None, s),
        "bwd_state_aug": lambda: L.bwd_state(q, k, w, gc, do, dvl, None, s, ny=dk, store=False),
        "inter": lambda: L.bwd_inter(q, k, w, u, gc, do, hbuf, dhbuf, dvnbuf, s),
        # includes the small q/k finish kernel; dkv is updated in place, which changes no timing
        "bwd_wy": lambda: L.bwd_prepare(q, k, v, beta, gc, tinv, dw, dvnbuf, dqv, dkv, dgc),
    }


TUNE_WARPS = (2, 4, 8)
TUNE_STAGES = {"state": (1, 2, 3), "bwd_state": (1, 2, 3), "inter": (1, 2, 3)}  # others keep theirs


def tune(T, warmup, repeat, dims=None, device="cuda", warps=TUNE_WARPS, stage_grid=None):
    """Per kernel, every num_warps (and for the pipelined loops num_stages, for the state passes the
    column block) at one T; keeps the fastest in ``launching`` (used for the tables after) -> report lines."""
    import itertools

    from cpcompile.kernels.gdn.triton import launching as L

    stage_grid = TUNE_STAGES if stage_grid is None else stage_grid
    calls = _kernel_calls(T, dims, device)
    lines = [f"Tuning at T={T} (ms of one launch; the chosen setting is marked *):", "",
             "| kernel | warps | stages | column block | ms |", "|---|---|---|---|---|"]
    for key, fn in calls.items():
        stages = stage_grid.get(key, (L.NUM_STAGES.get(key),))
        bvs = (32, 64) if key in L.STATE_BV else (None,)
        timings = {}
        for nw, st, bv in itertools.product(warps, stages, bvs):
            L.NUM_WARPS[key] = nw
            if st is not None:
                L.NUM_STAGES[key] = st
            if bv is not None:
                L.STATE_BV[key] = bv
            try:
                with _exact_stages():
                    timings[(nw, st, bv)] = time_cuda(fn, warmup, repeat)
            except Exception as exc:  # noqa: BLE001  (a setting can exceed shared memory)
                print(f"  tune {key} warps={nw} stages={st} bv={bv} failed: {type(exc).__name__}", flush=True)
        best = min(timings, key=timings.get)
        L.NUM_WARPS[key] = best[0]
        if best[1] is not None:
            L.NUM_STAGES[key] = best[1]
        if best[2] is not None:
            L.STATE_BV[key] = best[2]
        for cfg, ms in sorted(timings.items(), key=lambda kv: kv[1])[:4]:
            lines.append(f"| {key} | {cfg[0]} | {cfg[1] if cfg[1] is not None else '-'} | "
                         f"{cfg[2] if cfg[2] is not None else '-'} | {ms:.3f}{' *' if cfg == best else ''} |")
        print(f"  tune {key}: best {best} {timings[best]:.3f} ms of {len(timings)}", flush=True)
    lines += ["", f"Chosen: NUM_WARPS={L.NUM_WARPS}, NUM_STAGES={L.NUM_STAGES}, STATE_BV={L.STATE_BV}"]
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=None,
                    help="sequence lengths (default 8192..65536; with --p2p-variants 16384 32768 65536)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--ref-max-T", type=int, default=8192)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-lift-fla-guard", action="store_true")
    ap.add_argument("--tune", action="store_true",
                    help="first sweep each kernel's warps/stages/column block at T=16K and keep the fastest")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-kernel breakdown at T=16K")
    ap.add_argument("--profile-T", type=int, nargs="*", default=[16384, 65536],
                    help="torch-profiler kernel table of one fwd+bwd per method at these T (none: skip)")
    ap.add_argument("--p2p-variants", action="store_true",
                    help="only time the State-P2P variants: every forward against the plain forward, every "
                         "backward summary against the plain backward (no fla-core)")
    for key, vals in P2P_GRID.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, nargs="+", default=None,
                        help=f"--p2p-variants grid: {key} values (default {vals})")
    ap.add_argument("--smoke", action="store_true",
                    help="T=128, Hv=2, K=V=32 on the CPU interpreter (checks the code path only): the --tune "
                         "sweep, or with --p2p-variants those variants")
    args = ap.parse_args()
    if args.p2p_variants:
        return main_p2p_variants(args)
    if args.smoke:  # the tuner's code path on the CPU interpreter (tiny shape, one setting each)
        os.environ["TRITON_INTERPRET"] = "1"
        print("\n".join(tune(128, 0, 1, dims=(1, 1, 2, 32, 32), device="cpu", warps=(4,), stage_grid={})))
        return
    args.T = args.T or [8192, 16384, 32768, 65536]

    dev = torch.cuda.get_device_name()
    import triton
    env = f"torch {torch.__version__}, triton {triton.__version__}, device {dev}"
    print(env, flush=True)
    tuned = tune(16384, 2, 10) if args.tune else None

    rows, p2p_rows, layer_rows, acc, breakdown, profiles = [], [], [], [], {}, {}
    interrupted = None
    methods = [("cpcompile", "triton", ours())]
    if not args.no_fla:
        try:
            import fla
            methods.append(("fla-core", f"triton (fla {getattr(fla, '__version__', '?')}, guard lifted)"
                            if not args.no_lift_fla_guard else "triton (fla)", fla_method(not args.no_lift_fla_guard)))
        except Exception as exc:  # noqa: BLE001
            print(f"fla-core unavailable: {exc!r}")
    ref = torch_reference()
    try:  # Ctrl-C / `timeout -s INT`: write the table of what was measured so far
        acc += accuracy(4096, methods)
        for T in args.T:
            for name, backend, run in methods:
                try:
                    bench_method(name, backend, run, T, args.warmup, args.repeat, rows)
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} T={T} failed: {exc!r}", flush=True)
            if T <= args.ref_max_T:
                bench_method("hf-torch", "transformers torch_chunk_gated_delta_rule", ref, T, 1, 3, rows)
            bench_p2p(T, args.warmup, args.repeat, p2p_rows, with_fla=any(m[0] == "fla-core" for m in methods))
            bench_layer_ops(T, args.warmup, args.repeat, layer_rows)
            torch.cuda.empty_cache()
        for T in args.profile_T:
            profiles[T] = profile_kernels(T, methods)
        if not args.no_breakdown:
            breakdown.update(kernel_breakdown(16384, args.warmup, args.repeat))
            breakdown.update(ablation(16384, args.warmup, args.repeat))
            breakdown.update(api_overhead(16384, args.warmup, args.repeat))
    except KeyboardInterrupt:
        interrupted = "interrupted (time limit) before the end: the sections below hold what was measured"
        print(interrupted, flush=True)

    lines = [f"# GDN kernel benchmark — {_dt.date.today().isoformat()}", "", f"Environment: {env}.", "",
             *([f"**Run {interrupted}.**", ""] if interrupted else []),
             f"Shapes: B={B}, key heads {HK}, value heads {HV}, K=V={DK}, bf16 q/k/v/beta, fp32 g, "
             "use_qk_l2norm_in_kernel=True. Times: median over `repeat` iterations after `warmup` "
             "(CUDA events); peak memory of one forward+backward, inputs included.", "",
             "| method | backend | shapes (B,T,Hk,Hv,K,V) | warmup/repeat | fwd ms | fwd+bwd ms | peak alloc GiB | peak reserved GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['backend']} | ({B},{r['T']},{HK},{HV},{DK},{DV}) | {r['warmup']}/{r['repeat']} "
                     f"| {r['fwd']:.3f} | {r['fb']:.3f} | {r['alloc']:.2f} | {r['reserved']:.2f} |")
    lines += ["", "Ratios (cpcompile / other):", "", "| T | fwd vs fla | fwd+bwd vs fla | fwd vs hf-torch | fwd+bwd vs hf-torch |",
              "|---|---|---|---|---|"]
    for T in args.T:
        by = {r["method"]: r for r in rows if r["T"] == T}
        o = by.get("cpcompile")
        if o is None:
            continue

        def ratio(other, key):
            x = by.get(other)
            return f"{o[key] / x[key]:.2f}" if x and x[key] == x[key] else "-"
        lines.append(f"| {T} | {ratio('fla-core', 'fwd')} | {ratio('fla-core', 'fb')} | {ratio('hf-torch', 'fwd')} "
                     f"| {ratio('hf-torch', 'fb')} |")
    lines += ["", "State-P2P local cost (cpcompile kernels; incoming state given):", "",
              "| T | plain fwd ms | summary ms | output-with-state ms | summary+output+chain ms | ratio | plain bwd ms | p2p bwd (summary+chain+finish) ms | ratio | rel err o, H_out / grads, dH_in vs plain |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in p2p_rows:
        lines.append(f"| {r['T']} | {r['plain']:.3f} | {r['summary']:.3f} | {r['output']:.3f} | {r['p2p']:.3f} "
                     f"| {r['p2p'] / r['plain']:.2f} | {r['bplain']:.3f} | {r['bp2p']:.3f} | {r['bp2p'] / r['bplain']:.2f} "
                     f"| {r['err']:.1e} / {r['gerr']:.1e} |")
    lines += fla_cp_lines(p2p_rows, rows)
    lines += ["", "GDN CP wrappers' triton backend as the rewritten graph calls it (q/k fp32 in, v/beta bf16): "
              "plain local core `cpcompile::gdn_chunk` vs a middle rank's State-P2P executor "
              "(`cpcompile::gdn_p2p_chunk`, its sends and receives completing at once):", "",
              "| T | gdn_chunk fwd ms | P2P executor fwd ms | ratio | gdn_chunk fwd+bwd ms | P2P executor fwd+bwd ms | ratio |",
              "|---|---|---|---|---|---|---|"]
    for r in layer_rows:
        lines.append(f"| {r['T']} | {r['plain']:.3f} | {r['p2p']:.3f} | {r['p2p'] / r['plain']:.2f} | {r['bplain']:.3f} "
                     f"| {r['bp2p']:.3f} | {r['bp2p'] / r['bplain']:.2f} |")
    lines += ["", "Accuracy at T=4096 (same bf16 inputs; relative L2 error vs cpcompile's fp32 eager oracle):", ""]
    lines += [f"- {name}: {text}" for name, text in acc]
    if breakdown:
        lines += ["", "Per-kernel time at T=16384 (ms):", "", "| kernel | ms |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in breakdown.items()]
    for T, prof in profiles.items():
        lines += profile_lines(T, prof)
    if tuned:
        lines += ["", *tuned]
    write_report(lines, args.out, "gdn_kernels", dev)


def fla_cp_lines(p2p_rows, rows) -> list[str]:
    """The State-P2P local cost beside fla-core's context parallelism at the same T: its middle rank
    runs its plain forward / backward plus one summary kernel each (``fla_cp_summaries``)."""
    table = []
    for r in p2p_rows:
        fla = next((x for x in rows if x["method"] == "fla-core" and x["T"] == r["T"]), None)
        cp = r.get("fla_cp")
        if fla is None or cp is None:
            continue
        bwd = fla["fb"] - fla["fwd"]
        table.append(f"| {r['T']} | {fla['fwd']:.3f} + {cp['fwd']:.3f} | {(fla['fwd'] + cp['fwd']) / fla['fwd']:.2f} "
                     f"| {bwd:.3f} + {cp['bwd']:.3f} | {(bwd + cp['bwd']) / bwd:.2f} | {r['p2p']:.3f} / {r['bp2p']:.3f} "
                     f"| {cp['err']} |")
    if not table:
        return []
    return ["", "The same local cost for fla-core's context parallelism (`fla.ops.cp`, all-gather of "
            "summaries): its plain forward / backward (table above) plus its summary kernel, timed on the "
            "same prepared tensors. Ratios are to each library's own plain pass:", "",
            "| T | fla-core fwd + CP summary ms | ratio | fla-core bwd + CP summary ms | ratio | "
            "cpcompile State-P2P fwd / bwd ms | rel diff of fla's summaries from ours |",
            "|---|---|---|---|---|---|---|", *table]


def write_report(lines: list[str], out: str | None, stem: str, device_name: str) -> None:
    """Print the report and write it to ``out`` (default: benchmarks/results/<stem>_<date>_<device>.md)."""
    text = "\n".join(lines) + "\n"
    print(text)
    out = out or os.path.join(ROOT, "benchmarks", "results",
                              f"{stem}_{_dt.date.today().isoformat()}_{device_name.replace(' ', '-')}.md")
    with open(out, "w") as f:
        f.write(text)
    print("wrote", out)


def main_p2p_variants(args):
    grid = {key: getattr(args, key) for key in P2P_GRID if getattr(args, key) is not None}
    if args.smoke:  # the interpreter must be chosen before the kernels are first imported
        os.environ["TRITON_INTERPRET"] = "1"
        grid = {"hs": [1, 2], "sbv": [32], "sw": [4], "sst": [1], "bbv": [32], "bst": [1], "obv": [16, 32], "ow": [4],
                "ost": [1], "plain_obv": [32], "plain_ow": [4], **grid}
        bench_p2p_variants([128], 0, 1, grid, dims=(1, 1, 2, 32, 32), device="cpu")  # prints its table
        return
    import triton
    dev = torch.cuda.get_device_name()
    Ts = args.T or [16384, 32768, 65536]
    env = f"torch {torch.__version__}, triton {triton.__version__}, device {dev}"
    print(env, flush=True)
    lines = [f"# GDN State-P2P variants — {_dt.date.today().isoformat()}", "", f"Environment: {env}.", "",
             f"Shapes: B={B}, key heads {HK}, value heads {HV}, K=V={DK}, bf16; median of {args.repeat} after "
             f"{args.warmup} warm-ups. hs: chunks per stored summary state (0: launch.p2p_hstride's pick); sbv/sw/sst: the summary pass's value "
             "block / warps / stages; obv/ow/ost: output value block / warps / stages. "
             "Each output row takes its hs's fastest summary. bbv/bw/bst: the backward summary's reverse "
             "pass column block / warps / stages; its ratio adds the summary to a plain backward, whose "
             "dv_local the finish then skips (an upper estimate); its error column compares dH_local and M^T "
             "with the default setting's.", ""]
    try:
        lines += bench_p2p_variants(Ts, args.warmup, args.repeat, grid)
    except KeyboardInterrupt:
        lines += ["", "**interrupted: the table holds what was measured before**"]
    write_report(lines, args.out, "gdn_p2p_variants", dev)


if __name__ == "__main__":
    main()
