"""Triton GDN kernels against the eager oracle.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
set here before the kernels are first imported) at tiny shapes; with CUDA the ``gpu`` set runs at
T = 4K / 16K instead. Skipped cleanly when triton is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, tests/conftest.py chose Triton's CPU interpreter

pytest.importorskip("triton")

from cpcompile.errors import CPInputError  # noqa: E402
from cpcompile.kernels import chunk_gated_delta_rule  # noqa: E402
from cpcompile.kernels.gdn.eager import chunk_gated_delta_rule_eager  # noqa: E402
from cpcompile.kernels.gdn.summary import chain_grad_step, chain_step  # noqa: E402
from cpcompile.kernels.gdn.triton import GDNCapabilityError  # noqa: E402
from cpcompile.kernels.gdn.triton import capability as cap  # noqa: E402
from cpcompile.kernels.gdn.triton import kernel_ops as _ops  # noqa: E402,F401  (registers torch.ops.cpcompile.gdn_*)
from triton.runtime.errors import OutOfResources  # noqa: E402
import gdn_p2p_ops  # noqa: E402,F401  (registers the test-only torch.ops.cpcompile_test.gdn_p2p_*)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")
DEV = "cpu" if INTERPRET else "cuda"


def _inputs(B, T, Hk, Hv, K, V, dtype, *, seed, device=DEV, h0=False):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q = rnd(B, T, Hk, K)
    k = torch.nn.functional.normalize(rnd(B, T, Hk, K), dim=-1)
    v = rnd(B, T, Hv, V)
    g = torch.nn.functional.logsigmoid(rnd(B, T, Hv) + 2.0)  # log decay <= 0, a few % a token
    beta = torch.sigmoid(rnd(B, T, Hv))
    state = rnd(B, Hv, K, V) if h0 else None
    cast = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    return (*cast, g.to(device), beta.to(device=device, dtype=dtype), state.to(device) if state is not None else None)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _reference(q, k, v, g, beta, h0, do, dht, *, l2norm=False, dtype=torch.float64):
    """Oracle forward + autograd backward on upcast copies of the same (already rounded) inputs."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, g, beta)]
    h0r = h0.detach().to(dtype).requires_grad_() if h0 is not None else None
    o, ht = chunk_gated_delta_rule_eager(*leaves, initial_state=h0r, output_final_state=True,
                                         use_qk_l2norm_in_kernel=l2norm)
    loss = (o * do.to(dtype)).sum() + (ht * dht.to(dtype)).sum()
    loss.backward()
    grads = [x.grad for x in leaves] + [h0r.grad if h0r is not None else None]
    return o.detach(), ht.detach(), grads


def _check_fwd_bwd(B, T, Hk, Hv, K, V, dtype, *, h0, l2norm, seed, tol_fwd, tol_bwd):
    q, k, v, g, beta, state = _inputs(B, T, Hk, Hv, K, V, dtype, seed=seed, h0=h0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    h0t = state.clone().requires_grad_() if state is not None else None
    o, ht = chunk_gated_delta_rule(*leaves, initial_state=h0t, output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2norm, backend="triton")
    assert o.dtype == dtype and o.shape == (B, T, Hv, V) and ht.dtype == torch.float32
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 1)).to(o.device)
    dht = torch.randn(ht.shape, generator=torch.Generator().manual_seed(seed + 2)).to(o.device)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    ro, rht, rgrads = _reference(q, k, v, g, beta, state, do, dht, l2norm=l2norm)
    assert _rel(o, ro) < tol_fwd, ("o", _rel(o, ro))
    assert _rel(ht, rht) < tol_fwd, ("final state", _rel(ht, rht))
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, leaf, ref in zip(names, leaves + [h0t], rgrads):
        if ref is None:
            continue
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), name
        assert leaf.grad.dtype == leaf.dtype, name
        assert _rel(leaf.grad, ref) < tol_bwd, (name, _rel(leaf.grad, ref))


# ----------------------------------------------------------------------------- CPU interpreter set

CPU_CASES = [
    # B, T, Hk, Hv, K, V, dtype, h0, l2norm
    pytest.param(1, 64, 1, 1, 32, 32, torch.float32, False, False, id="one-chunk-fp32"),
    pytest.param(2, 100, 1, 2, 32, 32, torch.float32, True, False, id="partial-chunk-grouped-h0-fp32"),
    pytest.param(1, 128, 2, 4, 16, 32, torch.float32, True, True, id="KneV-l2norm-fp32"),
    pytest.param(1, 37, 1, 1, 64, 16, torch.float32, False, False, id="short-fp32"),
    pytest.param(1, 128, 1, 2, 32, 32, torch.bfloat16, True, True, id="bf16"),
]


@cpu_only
@pytest.mark.parametrize("B,T,Hk,Hv,K,V,dtype,h0,l2norm", CPU_CASES)
def test_fwd_bwd_match_oracle(B, T, Hk, Hv, K, V, dtype, h0, l2norm):
    tol_f, tol_b = (1e-5, 1e-5) if dtype == torch.float32 else (3e-2, 3e-2)
    _check_fwd_bwd(B, T, Hk, Hv, K, V, dtype, h0=h0, l2norm=l2norm, seed=T + K, tol_fwd=tol_f, tol_bwd=tol_b)


def _p2p_run(q, k, v, g, beta, h0, do, dht, cuts, scale):
    """Emulate State-P2P over segments with the cpcompile_test::gdn_p2p_* ops and the fp32 chain."""
    ops = torch.ops.cpcompile_test
    segs = list(zip(cuts[:-1], cuts[1:]))
    sl = [lambda x, a=a, b=b: x[:, a:b].contiguous() for a, b in segs]
    saved, h_ins, h = [], [], h0
    for s in sl:  # summaries are independent of the incoming state: all could run at once
        saved.append(ops.gdn_p2p_fwd_summary(s(k), s(v), s(g), s(beta)))
    for M, S, *_ in saved:  # the serial part: fp32 M @ H + S
        h_ins.append(h)
        h = chain_step(M, S, h)
    outs = [ops.gdn_p2p_fwd_output(s(q), s(k), *sv[2:5], sv[6], hi if hi is not None else torch.zeros_like(sv[1]),
                                   scale) for s, sv, hi in zip(sl, saved, h_ins)]
    dsum = [ops.gdn_p2p_bwd_summary(s(q), s(k), sv[3], sv[2], s(do), scale) for s, sv in zip(sl, saved)]
    d_outs, dh = [None] * len(segs), dht
    for i in reversed(range(len(segs))):  # the serial part backwards: dH_local + M^T dH
        d_outs[i] = dh
        dh = chain_grad_step(saved[i][0], dsum[i][0], dh)
    grads = [ops.gdn_p2p_bwd_finish(s(q), s(k), s(v), s(g), s(beta), sv[2], sv[3], sv[4], sv[5], s(do), hi,
                                    ds[2], dout, scale)
             for s, sv, hi, ds, dout in zip(sl, saved, h_ins, dsum, d_outs)]
    mts = [ds[1] for ds in dsum]
    return torch.cat(outs, 1), h, [torch.cat([gr[j] for gr in grads], 1) for j in range(5)], dh, saved, mts


def _check_p2p(B, T, Hk, Hv, K, V, dtype, cuts, *, seed, tol):
    q, k, v, g, beta, state = _inputs(B, T, Hk, Hv, K, V, dtype, seed=seed, h0=True)
    gen = torch.Generator().manual_seed(seed + 7)
    do = torch.randn(B, T, Hv, V, generator=gen).to(device=q.device, dtype=dtype)
    dht = torch.randn(B, Hv, K, V, generator=gen).to(q.device)
    o, ht, grads, dh0, saved, mts = _p2p_run(q, k, v, g, beta, state, do, dht, cuts, K ** -0.5)
    ro, rht, rgrads = _reference(q, k, v, g, beta, state, do, dht)
    assert _rel(o, ro) < tol and _rel(ht, rht) < tol
    for name, got, ref in zip(["dq", "dk", "dv", "dg", "dbeta"], grads, rgrads):
        assert _rel(got, ref) < tol, (name, _rel(got, ref))
    assert _rel(dh0, rgrads[5]) < tol
    # the backward pass's transposed suffix product equals the forward's M^T
    for sv, mt in zip(saved, mts):
        assert _rel(mt, sv[0].transpose(-1, -2)) < tol
    # each segment's (M, S) matches the oracle's summary
    from cpcompile.kernels.gdn.eager import gdn_segment_summary
    a, b = cuts[0], cuts[1]
    rm, rs = gdn_segment_summary(*(x[:, a:b].double() for x in (k, v, g, beta)))
    assert _rel(saved[0][0], rm) < tol and _rel(saved[0][1], rs) < tol


# every selectable State-P2P forward variant: chunks per stored summary state (= per group of the
# summary's identity programs) x column block of the output, of the summary's value and identity
# programs and of the chain (16: two of each per head at K = V = 32)
P2P_VARIANTS = [pytest.param(hs, bv, id=f"hs{hs}-bv{bv}") for hs in (1, 2, 16) for bv in (16, 32)]


def _p2p_variant(monkeypatch, hstride, bv):
    from cpcompile.kernels.gdn.triton import launching, p2p_output, p2p_summary

    monkeypatch.setattr(p2p_output, "P2P_HSTRIDE", hstride)
    monkeypatch.setattr(p2p_output, "P2P_OUTPUT_BV", bv)
    monkeypatch.setattr(p2p_summary, "P2P_IDENTITY_BV", bv)
    monkeypatch.setitem(launching.STATE_BV, "p2p_summary", bv)
    monkeypatch.setattr(p2p_summary, "P2P_CHAIN_BV", bv)


@cpu_only
@pytest.mark.parametrize("hstride,bv", P2P_VARIANTS)
def test_p2p_pieces_match_oracle(monkeypatch, hstride, bv):
    _p2p_variant(monkeypatch, hstride, bv)
    # segments of 2, 3 (one partial) and 1 (partial) chunks: full and ragged state groups
    _check_p2p(1, 320, 1, 2, 32, 32, torch.float32, [0, 72, 264, 320], seed=3, tol=1e-5)


@cpu_only
def test_p2p_pieces_match_oracle_bf16(monkeypatch):
    _p2p_variant(monkeypatch, 2, 16)
    _check_p2p(1, 320, 1, 2, 32, 32, torch.bfloat16, [0, 72, 264, 320], seed=4, tol=3e-2)


@cpu_only
def test_p2p_output_rejects_other_hstride(monkeypatch):
    from cpcompile.kernels.gdn.triton import launch, p2p_output

    q, k, v, g, beta, state = _inputs(1, 256, 1, 1, 16, 16, torch.float32, seed=6, h0=True)
    monkeypatch.setattr(p2p_output, "P2P_HSTRIDE", 1)
    _, _, saved = launch.p2p_fwd_summary(k, v, g, beta)
    monkeypatch.setattr(p2p_output, "P2P_HSTRIDE", 2)
    with pytest.raises(ValueError, match="same setting"):
        launch.p2p_fwd_output(q, k, saved, state, 0.25)


def test_p2p_hstride_fills_one_output_wave(monkeypatch):
    """The per-call State-P2P stride: about two output programs per SM, groups as long as that allows
    (a power of two within P2P_HSTRIDE_RANGE); a fixed P2P_HSTRIDE overrides it; no SMs, the shortest."""
    from types import SimpleNamespace

    from cpcompile.kernels.gdn.triton import launch, p2p_output

    monkeypatch.setattr(p2p_output, "P2P_HSTRIDE", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16

    def pick(B, Hv, NT):
        return launch.p2p_hstride(B, Hv, 128, NT, bf16, cuda)
    # 32 value heads x 2 value blocks = 64 programs a group: 4 groups for 264 slots
    assert [pick(1, 32, nt) for nt in (64, 128, 256, 512, 1024)] == [16, 32, 64, 128, 256]
    assert pick(1, 32, 4096) == 256 and pick(1, 32, 8) == 16  # the range's ends
    assert pick(1, 32, 258) == 128  # 65 chunks a group rounds up: 3 groups, the last one short
    assert pick(2, 32, 256) == 128 and pick(1, 8, 1024) == 64  # twice the heads: half the groups; a quarter: 4x
    assert launch.p2p_hstride(1, 32, 128, 1024, bf16, torch.device("cpu")) == 16
    monkeypatch.setattr(p2p_output, "P2P_HSTRIDE", 2)
    assert pick(1, 32, 1024) == 2


class _DeepKernel:
    """Stands in for a Triton kernel whose build needs more shared memory than the GPU has above
    ``fits`` pipeline stages; records the depths it was launched at."""

    def __init__(self, fits, resource="shared memory"):
        def fake_gdn_kernel():
            pass
        self.fn, self.fits, self.resource, self.tried = fake_gdn_kernel, fits, resource, []

    def __getitem__(self, grid):
        def run(*args, num_stages, **options):
            self.tried.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(40000 * num_stages, 40000 * self.fits, self.resource)
        return run


def test_launch_steps_down_to_fit_shared_memory(monkeypatch):
    """A pipeline deeper than the GPU's shared memory allows runs at the deepest that fits: one warning
    naming the kernel and both depths, then straight to that depth; none fits: the capability error."""
    import warnings

    from cpcompile.kernels.gdn.triton import launching

    monkeypatch.setattr(launching, "_FITTED_STAGES", {})
    kernel = _DeepKernel(fits=2)
    with pytest.warns(RuntimeWarning, match="fake_gdn_kernel .* tuned 4 pipeline stages; running it at 2"):
        launching.launch(kernel, (1,), "arg", num_stages=4, num_warps=4, BV=64)
    assert kernel.tried == [4, 3, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launching.launch(kernel, (1,), "arg", num_stages=4, num_warps=4, BV=64)
    assert kernel.tried == [4, 3, 2, 2]
    with pytest.warns(RuntimeWarning, match="tuned 3 pipeline stages"):  # Triton's default depth steps down too
        launching.launch(kernel, (1,), "arg", num_warps=4, BV=64)
    assert kernel.tried[-2:] == [3, 2]
    with pytest.raises(GDNCapabilityError, match="unsupported shared memory: fake_gdn_kernel needs 40000 at 1"):
        launching.launch(_DeepKernel(fits=0), (1,), num_stages=3, num_warps=4)
    monkeypatch.setattr(launching, "FIT_STAGES", False)  # a tuning sweep: the named depth or an error
    with pytest.raises(GDNCapabilityError, match="needs 160000 at 4"):
        launching.launch(_DeepKernel(fits=2), (1,), num_stages=4, num_warps=8)
    registers = _DeepKernel(fits=0, resource="registers")
    with pytest.raises(GDNCapabilityError, match="unsupported registers: fake_gdn_kernel needs 120000 at 3"):
        launching.launch(registers, (1,), num_stages=3, num_warps=4)
    assert registers.tried == [3]  # fewer stages do not save registers


@cpu_only
def test_prepare_without_tinv_gives_the_same_w_u():
    """A forward whose backward recomputes prepare skips tinv's store and nothing else."""
    from cpcompile.kernels.gdn.triton import launch

    _, k, v, g, beta, _ = _inputs(1, 100, 1, 2, 16, 16, torch.float32, seed=7, h0=False)
    full = launch.fwd_prepare(k, v, g, beta)
    lean = launch.fwd_prepare(k, v, g, beta, store_tinv=False)
    assert lean[3] is None and full[3] is not None
    for a, b in zip(lean[:3], full[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@cpu_only
def test_l2norm_inside_the_op_matches_torch():
    """q/k normalised inside cpcompile::gdn_chunk_fwd (forward kernel, backward finished in the last
    backward kernel) equals the formula in float64, forward and backward, with grouped heads."""
    q, k, v, g, beta, _ = _inputs(1, 70, 1, 2, 16, 16, torch.float32, seed=12)
    q, k = q * 3.0, k * 0.5  # not unit rows: the norm matters
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    o = torch.ops.cpcompile.gdn_chunk_fwd(*leaves, None, 0.25, True)[0]
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta)]
    qr, kr = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in ref_leaves[:2])
    orf = chunk_gated_delta_rule_eager(qr, kr, *ref_leaves[2:], scale=0.25)[0]
    do = torch.randn_like(o)
    o.backward(do)
    orf.backward(do.double())
    assert _rel(o, orf) < 1e-5
    for a, b in zip(leaves, ref_leaves):
        assert _rel(a.grad, b.grad) < 1e-4


@cpu_only
def test_backward_refuses_one_rstd_without_the_other():
    q, k, v, g, beta, _ = _inputs(1, 64, 1, 1, 16, 16, torch.float32, seed=13)
    o, ht, gc, w, u, tinv, qn, kn, q_rstd, _ = torch.ops.cpcompile.gdn_chunk_fwd(q, k, v, g, beta, None, 0.25, True)
    with pytest.raises(CPInputError, match="q_rstd and k_rstd"):
        torch.ops.cpcompile.gdn_chunk_bwd(qn, kn, v, g, beta, None, gc, w, u, tinv, torch.randn_like(o), None, 0.25,
                                          q_rstd, None)


@cpu_only
def test_opcheck_custom_ops():
    q, k, v, g, beta, state = _inputs(1, 40, 1, 2, 16, 16, torch.float32, seed=11, h0=True)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, state)]
    torch.library.opcheck(torch.ops.cpcompile.gdn_chunk_fwd.default, (*leaves, 0.25))
    torch.library.opcheck(torch.ops.cpcompile.gdn_chunk_fwd.default, (*leaves, 0.25, True))
    o, ht, gc, w, u, tinv, *_ = torch.ops.cpcompile.gdn_chunk_fwd(*[x.detach() for x in leaves], 0.25)
    qn, kn, q_rstd, k_rstd = torch.ops.cpcompile.gdn_chunk_fwd(*[x.detach() for x in leaves], 0.25, True)[6:]
    det = [x.detach() for x in (q, k, v, g, beta, state)]
    torch.library.opcheck(torch.ops.cpcompile.gdn_chunk_bwd.default,
                          (*det, gc, w, u, tinv, torch.randn_like(o), torch.randn_like(ht), 0.25))
    torch.library.opcheck(torch.ops.cpcompile.gdn_chunk_bwd.default,
                          (*det[:5], None, gc, w, u, tinv, torch.randn_like(o), None, 0.25))
    torch.library.opcheck(torch.ops.cpcompile.gdn_chunk_bwd.default,
                          (qn, kn, *det[2:5], None, gc, w, u, tinv, torch.randn_like(o), None, 0.25, q_rstd, k_rstd))
    s = torch.ops.cpcompile_test.gdn_p2p_fwd_summary(*det[1:5])
    torch.library.opcheck(torch.ops.cpcompile_test.gdn_p2p_fwd_summary.default, tuple(det[1:5]))
    torch.library.opcheck(torch.ops.cpcompile_test.gdn_p2p_fwd_output.default, (det[0], det[1], *s[2:5], s[6], det[5], 0.25))
    d = torch.ops.cpcompile_test.gdn_p2p_bwd_summary(det[0], det[1], s[3], s[2], torch.randn_like(o), 0.25)
    torch.library.opcheck(torch.ops.cpcompile_test.gdn_p2p_bwd_summary.default, (det[0], det[1], s[3], s[2], torch.randn_like(o), 0.25))
    torch.library.opcheck(torch.ops.cpcompile_test.gdn_p2p_bwd_finish.default,
                          (*det[:5], *s[2:6], torch.randn_like(o), det[5], d[2], torch.randn_like(ht), 0.25))


@cpu_only
def test_torch_compile_fullgraph():
    q, k, v, g, beta, state = _inputs(1, 64, 1, 2, 16, 16, torch.float32, seed=5, h0=True)

    def core(q, k, v, g, beta, h0):
        o, ht = chunk_gated_delta_rule(q, k * 1.0, v, g, beta, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
        return o.sum() + ht.sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, state)]
    compiled = torch.compile(core, fullgraph=True, backend="aot_eager")
    compiled(*leaves).backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v, g, beta, state)]
    core(*ref).backward()
    for a, b in zip(leaves, ref):
        assert _rel(a.grad, b.grad) < 1e-6


# ----------------------------------------------------------------------------- capability / API errors


def test_unknown_backend_is_rejected():
    x = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="unknown GDN backend 'fla'"):
        chunk_gated_delta_rule(x, x, x, torch.zeros(1, 4, 1), torch.zeros(1, 4, 1), backend="fla")


def _meta(*shape):
    return torch.zeros(*shape, device="meta", dtype=torch.bfloat16)


@pytest.mark.parametrize("case,capability", [
    ("head_dim", "head dim"), ("dtype", "dtype"), ("heads", "head count"), ("chunk", "chunk size"),
    ("length", "length"), ("long", "length"), ("grid", "grid"),
])
def test_capability_errors_name_the_cause(case, capability):
    B, T, Hk, Hv, K, V = 1, 8, 1, 2, 16, 16
    q = torch.zeros(B, T, Hk, K)
    v = torch.zeros(B, T, Hv, V)
    g = beta = torch.zeros(B, T, Hv)
    kwargs = {}
    if case == "head_dim":
        q = torch.zeros(B, T, Hk, 48)
    elif case == "dtype":
        q = q.half()
    elif case == "heads":
        q = torch.zeros(B, T, 3, K)
        v, g, beta = torch.zeros(B, T, 4, V), torch.zeros(B, T, 4), torch.zeros(B, T, 4)
    elif case == "chunk":
        kwargs["chunk_size"] = 32
    elif case == "length":
        q, v, g, beta = q[:, :0], v[:, :0], g[:, :0], beta[:, :0]
    elif case in ("long", "grid"):
        # long: one token past the 65535 chunks that have run on a GPU (offsets are int64);
        # grid: 32768 x 2 = 65536 batch x value-head programs, one more than grid axis 1 holds
        B, T = (1, cap.MAX_T + 1) if case == "long" else (32768, T)
        q, v, g = _meta(B, T, Hk, K), _meta(B, T, Hv, V), _meta(B, T, Hv)
        beta = g
    k = q.clone() if case != "dtype" else q.float()
    with pytest.raises(GDNCapabilityError) as err:
        cap.check_inputs(q, k, v, g, beta, **kwargs)
    assert err.value.capability == capability and capability in str(err.value)


def test_long_sequences_are_not_refused():
    """Offsets that grow with B or T are int64: the longest T (65535 chunks, 4M tokens) with 64 value
    heads of 128 (chunk states of 2^36 elements a batch row, past 32-bit offsets 32 times over) passes
    the checks, as do 65535 batch x value-head programs. Metadata only (meta tensors)."""
    for B, T, Hk, Hv, K in ((1, cap.MAX_T, 16, 64, 128), (13107, 64, 1, 5, 16)):
        q, v, g = _meta(B, T, Hk, K), _meta(B, T, Hv, K), _meta(B, T, Hv)
        cap.check_inputs(q, q, v, g, g)


def test_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(GDNCapabilityError, match="unsupported device: cpu tensors need TRITON_INTERPRET=1"):
        cap.check_device.__wrapped__("cpu", None)
    with pytest.raises(GDNCapabilityError, match="unsupported device: device type 'mps'"):
        cap.check_device.__wrapped__("mps", None)


def test_import_does_not_need_triton():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, cpcompile, cpcompile.kernels\n"
        "from cpcompile.kernels import chunk_gated_delta_rule\n"
        "assert 'cpcompile.kernels.gdn.triton' not in sys.modules\n"
        "x = torch.randn(1, 8, 1, 16)\n"
        "o, _ = chunk_gated_delta_rule(x, x, x, -torch.rand(1, 8, 1), torch.rand(1, 8, 1), backend='eager')\n"
        "assert o.shape == (1, 8, 1, 16)\n"
        "try:\n"
        "    chunk_gated_delta_rule(x, x, x, -torch.rand(1, 8, 1), torch.rand(1, 8, 1))\n"
        "except Exception as e:\n"
        "    assert 'unsupported dependency: triton is not installed' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('triton backend ran without triton')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# ----------------------------------------------------------------------------- GPU set


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA (and no TRITON_INTERPRET)")


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [4096, 16384])
def test_gpu_fwd_bwd_long(T):
    _check_fwd_bwd(1, T, 2, 4, 128, 128, torch.bfloat16, h0=True, l2norm=True, seed=T, tol_fwd=2e-2, tol_bwd=3e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("D, dtype, seed, tol_fwd, tol_bwd", [(64, torch.bfloat16, 64, 2e-2, 3e-2),  # the one size < 128
                                                              (128, torch.float32, 9, 1e-3, 2e-3)])
def test_gpu_fwd_bwd_head_dim_64_and_fp32(D, dtype, seed, tol_fwd, tol_bwd):
    _check_fwd_bwd(1, 4096 + 37, 2, 4, D, D, dtype, h0=True, l2norm=True, seed=seed, tol_fwd=tol_fwd,
                   tol_bwd=tol_bwd)


@pytest.mark.parametrize("D", [16, 32])
def test_cuda_refuses_head_dims_below_64(D):
    """16 and 32 gave NaN outputs and key gradients on an H100 (Triton 3.6, 2026-12-06): refused on
    CUDA before any kernel runs, naming the cause (the interpreter still runs them). Fake CUDA
    tensors: the check reads metadata only, so it runs without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cpcompile.errors import GDNCapabilityError
    from cpcompile.kernels.gdn.triton.capability import check_inputs

    with FakeTensorMode():
        q = torch.zeros(1, 64, 2, D, device="cuda", dtype=torch.bfloat16)
        v = torch.zeros(1, 64, 4, D, device="cuda", dtype=torch.bfloat16)
        g = torch.zeros(1, 64, 4, device="cuda")
        with pytest.raises(GDNCapabilityError, match="at least 64"):
            check_inputs(q, q, v, g, g.bfloat16())


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [4096, 16384])
def test_gpu_p2p_long(T):
    cuts = [0, T // 4 + 17, T // 2, T]
    _check_p2p(1, T, 2, 4, 128, 128, torch.bfloat16, cuts, seed=T + 1, tol=3e-2)


@gpu
@needs_cuda
def test_gpu_overdeep_pipeline_steps_down(monkeypatch):
    """A summary pass asked for 8 stages (an H200 fits 5 at K = V = 128) warns, runs at a depth that
    fits and gives what the tuned depth gives, bit for bit."""
    from cpcompile.kernels.gdn.triton import launch, launching

    _, k, v, g, beta, _ = _inputs(1, 4096 + 37, 2, 4, 128, 128, torch.bfloat16, seed=11)
    tuned = launch.p2p_fwd_summary(k, v, g, beta)
    monkeypatch.setattr(launching, "_FITTED_STAGES", {})
    monkeypatch.setitem(launching.NUM_STAGES, "p2p_summary", 8)
    with pytest.warns(RuntimeWarning, match="gdn_p2p_summary_kernel .* tuned 8 pipeline stages; running it at"):
        deep = launch.p2p_fwd_summary(k, v, g, beta)
    for a, b in zip([*tuned[:2], tuned[2][4]], [*deep[:2], deep[2][4]]):  # M, S, the stored [P | h0]
        assert torch.equal(a, b)


@gpu
@needs_cuda
def test_gpu_p2p_qwen_heads_long_groups():
    """Qwen3.5's heads give few, long State-P2P groups (``p2p_hstride``), the last one short."""
    from cpcompile.kernels.gdn.triton import launch

    T = 16384 + 100
    cuts = [0, T // 4 + 17, T // 2, T]
    nt_last = launch.triton_cdiv(T - T // 2, 64)
    hs = launch.p2p_hstride(1, 32, 128, nt_last, torch.bfloat16, torch.device("cuda"))
    assert hs > 16 and nt_last % hs, (hs, nt_last)
    _check_p2p(1, T, 16, 32, 128, 128, torch.bfloat16, cuts, seed=T, tol=3e-2)
