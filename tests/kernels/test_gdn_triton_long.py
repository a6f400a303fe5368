"""Triton GDN kernels past 32-bit offsets and grid limits (GPU only, ``-m gpu``).

The chunk-state buffers hold ``ceil(T/64) * Hv * K * NS`` elements a batch row: with 16 value heads
of K = V = 128 the plain path's pass 2^31 at 512K tokens, State-P2P's ``[P | h0]`` states (NS = K + V)
at 256K with one stored state a chunk. Their offsets are int64; these tests run there (on one H200,
2026-12-02: 288K and 576K chained, State-P2P at 288K, all passed). Past 65535 chunks (4M tokens) the
kernels are refused (capability.MAX_CHUNKS): a 4M-token run with small heads hit an illegal memory
access on the H200, cause not found yet.

No oracle runs at these lengths (the float64 eager core would need hundreds of GiB); the check is an
exact decomposition instead. A sequence split at a chunk boundary is the first half's run chained into
the second's through the fp32 final state: the same chunk steps in the same order, so outputs, final
state and (backprop through both halves) every gradient must agree with the one long run up to
rounding, and a stretch of chunks written at a wrapped offset cannot. State-P2P's forward is checked
against the plain one. Peak memory, estimated: about 40 GB (576K); the others need less. The same
checks run at small shapes in the CPU interpreter, so that they keep working where no GPU runs them.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

pytest.importorskip("triton")

from cpcompile.kernels import chunk_gated_delta_rule  # noqa: E402
from cpcompile.kernels.gdn.summary import chain_step  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA (and no TRITON_INTERPRET)")
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")

DIMS = (8, 16, 128, 128)  # key heads, value heads, K, V
CHUNK = 64
BLOCK = 1 << 26  # elements compared at a time: fp32 copies of whole [T, Hv, V] tensors would cost GiBs


def _inputs(T, seed, dims=DIMS, device="cuda"):
    """bf16 q, k, v, beta, fp32 g and initial state; q/k are L2-normalised in the op. The decay is
    mild (about 2% a token) so that a state carries across several chunks, and so across the cut."""
    Hk, Hv, K, V = dims
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)
    q, k = rnd(1, T, Hk, K).bfloat16(), rnd(1, T, Hk, K).bfloat16()
    v = rnd(1, T, Hv, V).bfloat16()
    g = torch.nn.functional.logsigmoid(rnd(1, T, Hv) + 4.0)
    beta = torch.sigmoid(rnd(1, T, Hv)).bfloat16()
    h0 = rnd(1, Hv, K, V)
    return q, k, v, g, beta, h0


def _assert_close(name, got, ref, rtol, max_rtol):
    """Finite everywhere; ``|got - ref| / |ref|`` (norms) below ``rtol``; the largest difference below
    ``max_rtol`` times the largest ``|ref|`` (a corrupted stretch cannot hide in a long norm)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (name, got.shape, ref.shape, got.dtype, ref.dtype)
    a, b = got.reshape(-1), ref.reshape(-1)
    sq_diff = sq_ref = max_diff = max_ref = 0.0
    for s in range(0, a.numel(), BLOCK):
        x, y = a[s:s + BLOCK].double(), b[s:s + BLOCK].double()
        assert torch.isfinite(x).all() and torch.isfinite(y).all(), f"{name}: not finite in [{s}, +{BLOCK})"
        d = x - y
        sq_diff += float(d.square().sum())
        sq_ref += float(y.square().sum())
        max_diff = max(max_diff, float(d.abs().max()))
        max_ref = max(max_ref, float(y.abs().max()))
    rel = (sq_diff / max(sq_ref, 1e-300)) ** 0.5
    assert rel < rtol, f"{name}: relative error {rel:.3e} >= {rtol}"
    assert max_diff <= max_rtol * max_ref, f"{name}: largest difference {max_diff:.3e} vs largest |ref| {max_ref:.3e}"


def _leaves(*xs):
    """Leaves that share the tensors' memory (no copy: a half of a [1, T, ...] tensor is contiguous)."""
    return [x.detach().requires_grad_() for x in xs]


def _run(q, k, v, g, beta, h0):
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, backend="triton")


def _check_chain_of_halves(T, dims=DIMS, device="cuda"):
    """One run of T tokens against its two halves chained through the final state (module doc)."""
    _, Hv, K, V = dims
    q, k, v, g, beta, h0 = _inputs(T, T, dims, device)
    gen = torch.Generator(device=device).manual_seed(T + 1)
    do = torch.randn(1, T, Hv, V, device=device, generator=gen).bfloat16()
    dht = torch.randn(1, Hv, K, V, device=device, generator=gen)
    cut = (T // 2) // CHUNK * CHUNK  # a chunk boundary: both halves step the same chunks as the long run

    full = _leaves(q, k, v, g, beta, h0)
    o, ht = _run(*full)
    grads = torch.autograd.grad((o, ht), full, (do, dht))
    o, ht = o.detach(), ht.detach()
    del full

    first = _leaves(*(x[:, :cut] for x in (q, k, v, g, beta)), h0)
    second = _leaves(*(x[:, cut:] for x in (q, k, v, g, beta)))
    o1, ht1 = _run(*first)
    o2, ht2 = _run(*second, ht1)  # the second half enters with the first's fp32 final state
    chained = torch.autograd.grad((o1, o2, ht2), first + second, (do[:, :cut], do[:, cut:], dht))
    del first, second

    _assert_close("o[:cut]", o1.detach(), o[:, :cut], 1e-3, 1e-2)
    _assert_close("o[cut:]", o2.detach(), o[:, cut:], 1e-3, 1e-2)
    _assert_close("final state", ht2.detach(), ht, 1e-4, 1e-3)
    names = ["dq", "dk", "dv", "dg", "dbeta"]
    for i, name in enumerate(names):
        _assert_close(f"{name}[:cut]", chained[i], grads[i][:, :cut], 2e-3, 2e-2)
        _assert_close(f"{name}[cut:]", chained[6 + i], grads[i][:, cut:], 2e-3, 2e-2)
    _assert_close("dh0", chained[5], grads[5], 2e-3, 2e-2)


@cpu_only
def test_chain_of_halves_check_in_the_interpreter():
    """The GPU tests' decomposition at a small shape (T = 4.6 chunks, cut after the second)."""
    _check_chain_of_halves(64 * 4 + 37, dims=(1, 2, 32, 32), device="cpu")


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [
    # past the old refusal (ceil(T/64) * Hv * K * (K + V) >= 2^31 from 256K on), a partial last chunk
    pytest.param(288 * 1024 + 37, id="288K"),
    # the plain path's chunk states ([NT, Hv, K, V] = 2.4e9 elements) pass 2^31 from chunk 8192 on
    pytest.param(576 * 1024 + 37, id="576K"),
])
def test_gpu_long_sequence_is_the_chain_of_its_halves(T):
    _check_chain_of_halves(T)


@gpu
@needs_cuda
def test_gpu_long_sequence_with_small_heads_is_the_chain_of_its_halves():
    """288K tokens with 2 value heads of 64 (the 4M check that failed had heads of 16, which gave NaN
    on an H100 at 4K too and are refused on GPUs since): the length alone, 65601 chunks."""
    _check_chain_of_halves(288 * 1024 + 37, dims=(1, 2, 64, 64))


def _check_p2p_against_plain(monkeypatch, T, dims=DIMS, device="cuda"):
    """State-P2P's forward with one stored ``[P | h0]`` state a chunk (``P2P_HSTRIDE = 1``, one group a
    chunk): output and ``M H_in + S`` against the plain forward from the same incoming state."""
    from cpcompile.kernels.gdn.triton import launch, p2p_output

    monkeypatch.setattr(p2p_output, "P2P_HSTRIDE", 1)
    q, k, v, g, beta, h_in = _inputs(T, 5, dims, device)
    q, k = launch.l2norm_fwd(q)[0], launch.l2norm_fwd(k)[0]
    scale = dims[2] ** -0.5
    o, ht, *_ = launch.gdn_fwd(q, k, v, g, beta, h_in, scale, store_tinv=False)
    M, S, saved = launch.p2p_fwd_summary(k, v, g, beta)
    if dims == DIMS:
        assert saved[4].numel() > 2 ** 31, saved[4].shape
    o_p2p = launch.p2p_fwd_output(q, k, saved, h_in, scale)
    del saved
    # two bf16 roundings of different states (h0 + P H_in per chunk against the stepped state)
    _assert_close("o", o_p2p, o, 2e-2, 5e-2)
    _assert_close("final state", chain_step(M, S, h_in), ht, 2e-2, 5e-2)


@cpu_only
def test_p2p_against_plain_check_in_the_interpreter(monkeypatch):
    _check_p2p_against_plain(monkeypatch, 64 * 4 + 37, dims=(1, 2, 32, 32), device="cpu")


@gpu
@needs_cuda
@pytest.mark.parametrize("T,dims", [
    # the summary's states ([NT, Hv, K, K + V] = 2.4e9 elements) pass 2^31
    pytest.param(288 * 1024 + 37, DIMS, id="288K"),
])
def test_gpu_p2p_forward_one_group_a_chunk(monkeypatch, T, dims):
    _check_p2p_against_plain(monkeypatch, T, dims)
