"""The Triton GDN kernels with packed documents (`starts`): a document start reaches them as a
reset gate (`common.reset_decay_at_starts`), so they must agree with the eager oracle's exact
resets — outputs and every input gradient, with a zero decay gradient at each start — and another
document's tokens may reach an output by no more than the reset gate lets through (exp(-30)).

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py); the `gpu` test
runs them in bf16 on CUDA, judged against the fp32 eager oracle.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from test_gdn_eager import rel_err

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")
CHUNK = 64  # the only chunk size the Triton kernels take


def _inputs(seq_len: int, seed: int, device="cpu", batch: int = 1, k_heads: int = 1, v_heads: int = 2,
            k_dim: int = 16, v_dim: int = 16):
    """As the Qwen3.5 layer hands them to the core: q/k L2-normalised fp32, g fp32 (log decay)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, seq_len, k_heads, k_dim, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, seq_len, k_heads, k_dim, generator=gen), dim=-1)
    v = torch.randn(batch, seq_len, v_heads, v_dim, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(batch, seq_len, v_heads, generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(batch, seq_len, v_heads, generator=gen))
    h0 = torch.randn(batch, v_heads, k_dim, v_dim, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta, h0)]


def _starts(seq_len: int, seed: int, device="cpu") -> torch.Tensor:
    """Starts at a chunk's first token (64), two adjacent (a one-token document), and random ones;
    none at 0, so the row opens with the rest of a document that continues the initial state."""
    starts = torch.zeros(1, seq_len, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    starts[0, torch.randint(1, seq_len, (3,), generator=gen)] = True
    starts[0, [17, 18, CHUNK]] = True
    return starts.to(device)


def _run(backend: str, inputs, starts, d_o):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o = torch.ops.cpcompile.gdn_chunk(*leaves, 0.25, CHUNK, backend, starts)
    (o.float() * d_o).sum().backward()
    return [o.detach()] + [x.grad for x in leaves]


@cpu_only
@pytest.mark.parametrize("seq_len", [100, 128])
def test_triton_with_starts_matches_the_eager_resets(seq_len):
    """fp32, with an initial state (it reaches the first document only): outputs and the gradients
    of q, k, v, g, beta and the initial state within 1e-4 of the eager oracle; dg is 0 at starts."""
    seed = random.randrange(1 << 30)
    inputs, starts = _inputs(seq_len, seed), _starts(seq_len, seed)
    d_o = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(seed + 1))
    got, want = _run("triton", inputs, starts, d_o), _run("eager", inputs, starts, d_o)
    errors = {name: rel_err(a, b) for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want)}
    assert max(errors.values()) <= 1e-4, (seed, errors)
    assert torch.equal(got[4][starts], torch.zeros_like(got[4][starts])), "decay gradient at a start"


@cpu_only
def test_another_document_reaches_no_output_beyond_the_reset_gate():
    """Moving the last token of a document changes the later documents' outputs by at most what
    exp(-30) lets through (relative 1e-9 here), while its own document's outputs change."""
    seed = random.randrange(1 << 30)
    q, k, v, g, beta, _ = _inputs(100, seed)
    starts = torch.zeros(1, 100, dtype=torch.bool)
    starts[0, [0, 40, 70]] = True
    run = lambda *x: torch.ops.cpcompile.gdn_chunk(*x, None, 0.25, CHUNK, "triton", starts)
    before = run(q, k, v, g, beta)
    for i, x in enumerate((q, k, v, beta)):
        moved = x.clone()
        moved[0, 69] += 0.5  # the last token of document 2, in the chunk of document 3
        args = [moved if j == i else y for j, y in enumerate((q, k, v, beta))]
        after = run(*args[:3], g, args[3])
        assert not torch.equal(before[:, 40:70], after[:, 40:70]), i
        assert torch.equal(before[:, :40], after[:, :40]), i
        leak = (before[:, 70:] - after[:, 70:]).abs().max() / before[:, 70:].abs().max()
        assert leak <= 1e-9, (i, leak.item())


@cpu_only
def test_opcheck_triton_with_starts():
    q, k, v, g, beta, h0 = _inputs(70, seed=3)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    torch.library.opcheck(torch.ops.cpcompile.gdn_chunk.default, (*leaves, 0.25, CHUNK, "triton", _starts(70, 3)))


@cpu_only
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_cu_seqlens_runs_each_document_as_if_alone(backend):
    """`chunk_gated_delta_rule(..., cu_seqlens=)`, fla-core's packing argument: each document's
    outputs equal that document run alone (1e-5, fp32); per-document states are refused."""
    from cpcompile.errors import CPInputError
    from cpcompile.kernels import chunk_gated_delta_rule

    q, k, v, g, beta, h0 = _inputs(150, random.randrange(1 << 30))
    cu_seqlens = torch.tensor([0, 1, 40, 64, 130, 150])
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, backend=backend, cu_seqlens=cu_seqlens)
    assert final is None
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        alone, _ = chunk_gated_delta_rule(*(x[:, a:b] for x in (q, k, v, g, beta)), backend=backend)
        assert rel_err(out[:, a:b], alone) <= 1e-5, (a, b)
    with pytest.raises(CPInputError, match="per-document initial and final states"):
        chunk_gated_delta_rule(q, k, v, g, beta, backend=backend, cu_seqlens=cu_seqlens, initial_state=h0)
    with pytest.raises(CPInputError, match="cu_seqlens must rise strictly"):
        chunk_gated_delta_rule(q, k, v, g, beta, backend=backend, cu_seqlens=torch.tensor([0, 40, 40, 150]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_gpu_triton_packed_bf16_judged_against_fp32():
    """On CUDA, bf16 Qwen3.5 head shapes (K = V = 128, 2 V heads per K head), 8K tokens of packed
    documents: the triton core's error against the fp32 eager oracle (with starts) is within 1.5x
    (+1e-3) the error of the same documents run one by one through the triton core in bf16 —
    outputs and every input gradient."""
    from cpcompile.parity import within_precision

    seed = random.randrange(1 << 30)
    q, k, v, g, beta, _ = _inputs(8192, seed, "cuda", k_heads=2, v_heads=4, k_dim=128, v_dim=128)
    starts = torch.zeros(1, 8192, dtype=torch.bool, device="cuda")
    starts[0, torch.randint(1, 8192, (12,), generator=torch.Generator().manual_seed(seed)).cuda()] = True
    starts[0, [0, 4096, 4097]] = True
    bounds = starts[0].nonzero().flatten().tolist() + [8192]
    d_o = torch.randn(v.shape, generator=torch.Generator().manual_seed(seed + 1)).cuda()

    def run(backend, dtype, packed):
        leaves = [x.to(dtype if i in (2, 4) else torch.float32, copy=True).requires_grad_()
                  for i, x in enumerate((q, k, v, g, beta))]
        core = lambda *x, s=None: torch.ops.cpcompile.gdn_chunk(*x, None, 128 ** -0.5, CHUNK, backend, s)
        if packed:
            out = core(*leaves, s=starts)
        else:
            out = torch.cat([core(*(x[:, a:b] for x in leaves)) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
        (out.float() * d_o).sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    want = run("eager", torch.float32, True)
    packed, alone = run("triton", torch.bfloat16, True), run("triton", torch.bfloat16, False)
    errors = [(rel_err(p.float(), w), rel_err(a.float(), w)) for p, a, w in zip(packed, alone, want)]
    print("triton packed / alone bf16 vs fp32:", [f"{p:.1e}/{a:.1e}" for p, a in errors])
    assert all(within_precision(p, a) for p, a in errors), (seed, errors)
