"""The eager GDN kernels with packed documents (`starts`): beside the token recurrence with state
resets, beside each document run alone, and the summary algebra State-P2P relies on — a segment
holding a document start has M = 0 and S = the state after its last start.
"""
from __future__ import annotations

import random

import pytest
import torch

from cpcompile.errors import CPInputError
from cpcompile.kernels.gdn.eager import chunk_gated_delta_rule_eager, gdn_segment_summary
from cpcompile.kernels.gdn.naive import naive_recurrent_gated_delta_rule
from test_gdn_eager import make_inputs, rel_err


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = random.randrange(2**31)
    print(f"torch seed {seed}")
    torch.manual_seed(seed)


def random_starts(batch: int, seq_len: int, count: int = 4) -> torch.Tensor:
    """Document starts at random tokens (the first token always, some adjacent: one-token documents)."""
    starts = torch.zeros(batch, seq_len, dtype=torch.bool)
    starts[:, 0] = True
    for row in starts:
        row[torch.randint(1, seq_len, (count,))] = True
    return starts


@pytest.mark.parametrize("chunk_size", [4, 8, 64])
def test_chunk_with_starts_matches_recurrence_with_resets(chunk_size):
    q, k, v, g, beta, h0 = make_inputs(dtype=torch.float64)
    starts = random_starts(2, q.shape[1])
    starts[1, 0] = False  # row 1 continues the initial state until its first start
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, starts=starts)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, h0)]
    o, s = chunk_gated_delta_rule_eager(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    grads = torch.autograd.grad((o * o).sum() + s.sum(), leaves)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    grads_ref = torch.autograd.grad((o_ref * o_ref).sum() + s_ref.sum(), leaves)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10
    for got, want in zip(grads, grads_ref):
        assert rel_err(got, want) < 1e-10


def test_each_document_as_if_alone():
    q, k, v, g, beta, _ = make_inputs(batch=1, dtype=torch.float64, state=False)
    starts = random_starts(1, q.shape[1])
    out, _ = chunk_gated_delta_rule_eager(q, k, v, g, beta, chunk_size=8, starts=starts, use_qk_l2norm_in_kernel=True)
    bounds = starts[0].nonzero().flatten().tolist() + [q.shape[1]]
    for a, b in zip(bounds[:-1], bounds[1:]):
        alone, _ = chunk_gated_delta_rule_eager(*(t[:, a:b] for t in (q, k, v, g, beta)), chunk_size=8,
                                                use_qk_l2norm_in_kernel=True)
        assert rel_err(out[:, a:b], alone) < 1e-12


def test_summary_after_a_start_forgets_the_entering_state():
    _, k, v, g, beta, h0 = make_inputs(dtype=torch.float64)
    starts = random_starts(2, k.shape[1], count=2)
    starts[:, 0] = False
    starts[:, 20] = True
    m, s = gdn_segment_summary(k, v, g, beta, chunk_size=8, starts=starts, use_qk_l2norm_in_kernel=True)
    _, final = naive_recurrent_gated_delta_rule(k, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, starts=starts)
    assert torch.equal(m, torch.zeros_like(m))
    assert rel_err(s, final) < 1e-10


def test_other_documents_reach_no_output_bit_for_bit():
    q, k, v, g, beta, _ = make_inputs(batch=1, seq_len=24, state=False)
    starts = torch.zeros(1, 24, dtype=torch.bool)
    starts[0, [0, 10, 13]] = True
    run = lambda *x: chunk_gated_delta_rule_eager(*x, chunk_size=8, starts=starts, use_qk_l2norm_in_kernel=True)[0]
    before = run(q, k, v, g, beta)
    for i in range(5):
        moved = [t.clone() for t in (q, k, v, g, beta)]
        moved[i][0, 9] += 0.5  # the last token of document 1, in the chunk of documents 2 and 3
        after = run(*moved)
        assert torch.equal(before[:, :9], after[:, :9]) and torch.equal(before[:, 10:], after[:, 10:]), i


def test_starts_must_be_bool_tokens():
    q, k, v, g, beta, _ = make_inputs(state=False)
    with pytest.raises(CPInputError, match="starts"):
        chunk_gated_delta_rule_eager(q, k, v, g, beta, starts=torch.zeros(2, q.shape[1]))


def test_ops_take_starts():
    """`cpcompile::gdn_chunk` / `gdn_summary` with starts: schema, fake and autograd agree (opcheck),
    and starts that are not bool tokens are refused (the triton backend's: test_gdn_triton_documents)."""
    from cpcompile.kernels.gdn import layer_ops  # noqa: F401  (registers the ops)

    q, k, v, g, beta, h0 = make_inputs(batch=1, seq_len=13, dtype=torch.float64)
    starts = random_starts(1, 13, count=2)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, h0)]
    torch.library.opcheck(torch.ops.cpcompile.gdn_chunk.default, (*leaves, 0.3, 4, "eager", starts))
    torch.library.opcheck(torch.ops.cpcompile.gdn_summary.default, (*leaves[1:5], 4, "eager", starts))
    with pytest.raises(CPInputError, match="starts"):
        torch.ops.cpcompile.gdn_chunk(*leaves, 0.3, 4, "eager", starts.long())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packed_bf16_judged_against_fp32():
    """On CUDA, bf16: the packed eager core's error against its fp32 run is within 1.5x (+1e-3)
    the error of the same documents run one by one in bf16 — outputs and every input gradient."""
    from cpcompile.parity import within_precision

    q, k, v, g, beta, _ = make_inputs(batch=1, seq_len=2048, k_heads=4, v_heads=8, k_dim=64, v_dim=64, state=False)
    starts = random_starts(1, q.shape[1], count=7).cuda()
    inputs = [t.cuda() for t in (q, k, v, g, beta)]
    bounds = starts[0].nonzero().flatten().tolist() + [q.shape[1]]

    def run(dtype, packed):
        leaves = [t.to(dtype if i != 3 else torch.float32, copy=True).requires_grad_() for i, t in enumerate(inputs)]
        if packed:
            out, _ = chunk_gated_delta_rule_eager(*leaves, chunk_size=64, starts=starts, use_qk_l2norm_in_kernel=True)
        else:
            out = torch.cat([chunk_gated_delta_rule_eager(*(t[:, a:b] for t in leaves), chunk_size=64,
                                                          use_qk_l2norm_in_kernel=True)[0]
                             for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
        out.float().square().sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    want = run(torch.float32, True)
    packed, alone = run(torch.bfloat16, True), run(torch.bfloat16, False)
    errors = [(rel_err(p.float(), w), rel_err(a.float(), w)) for p, a, w in zip(packed, alone, want)]
    print("packed / alone bf16 vs fp32:", [f"{p:.1e}/{a:.1e}" for p, a in errors])
    assert all(within_precision(p, a) for p, a in errors), errors
