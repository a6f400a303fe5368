"""The eager GDN backend beside its oracles: the token recurrence, transformers' torch references,
an explicit per-token transition product, and autograd itself (for the CP state-gradient chain).

Inputs are fresh random per test (the seed is printed, so a failure can be replayed).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import random

import pytest
import torch
import torch.nn.functional as F

from cpcompile.kernels.gdn import eager, inputs, naive, summary
from cpcompile.kernels.gdn.common import l2norm as l2_normalize
from cpcompile.kernels.gdn.eager import chunk_gated_delta_rule_eager, gdn_local_state_grad, gdn_segment_summary
from cpcompile.kernels.gdn.naive import naive_recurrent_gated_delta_rule
from cpcompile.kernels.gdn.summary import apply_summary, combine_summaries, summary_adjoint
from gdn_summary_chain import chain_state_grads, compose_summaries

TOL = {torch.float64: 1e-10, torch.float32: 5e-6}  # measured fp32 worst ~4e-7


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = random.randrange(2**31)  # fresh per test; every input below comes from torch's RNG
    print(f"torch seed {seed}")  # shown by pytest on failure
    torch.manual_seed(seed)
    return seed


def make_inputs(
    *, batch=2, seq_len=37, k_heads=2, v_heads=4, k_dim=8, v_dim=6, dtype=torch.float32, l2norm=True, state=True,
    decay_bias=2.0, beta_max=0.98,
):
    """GDN inputs in the Qwen3.5 layout; without in-kernel l2norm, keys are shrunk so that
    ``beta |k|^2 < 1`` keeps the delta rule contractive (raw randn keys would blow the state up).
    A larger ``decay_bias`` / smaller ``beta_max`` makes the state forget more slowly."""
    q = torch.randn(batch, seq_len, k_heads, k_dim, dtype=dtype)
    k = torch.randn(batch, seq_len, k_heads, k_dim, dtype=dtype)
    if not l2norm:
        k = F.normalize(k, dim=-1) * torch.empty(batch, seq_len, k_heads, 1, dtype=dtype).uniform_(0.3, 1.0)
    v = torch.randn(batch, seq_len, v_heads, v_dim, dtype=dtype)
    g = F.logsigmoid(torch.randn(batch, seq_len, v_heads, dtype=dtype) + decay_bias)
    beta = torch.rand(batch, seq_len, v_heads, dtype=dtype).clamp(0.02, beta_max)
    h0 = torch.randn(batch, v_heads, k_dim, v_dim, dtype=dtype) if state else None
    return q, k, v, g, beta, h0


def rel_err(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def assert_close(actual, expected, tol, what=""):
    scale = expected.abs().max().clamp_min(1.0)
    err = ((actual.double() - expected.double()).abs().max() / scale).item()
    assert err <= tol, f"{what}: max error {err:.3e} > {tol:.1e}"


def run_with_grads(fn, inputs, d_o, d_state, **kwargs):
    """Forward + backward with given upstream gradients; returns (o, final_state, grads of inputs)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    q, k, v, g, beta, h0 = leaves
    o, final = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kwargs)
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad((o, final), wrt, grad_outputs=(d_o.to(o.dtype), d_state))
    return o.detach(), final.detach(), grads


# ----------------------------------------------------------------------------- chunk == recurrence


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [4, 16, 64])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunk_matches_recurrence_outputs_state_and_grads(dtype, chunk_size, with_state, l2norm):
    inputs = make_inputs(seq_len=37, dtype=dtype, l2norm=l2norm, state=with_state)  # 37: not a chunk multiple
    v, h_shape = inputs[2], (2, 4, 8, 6)
    d_o, d_state = torch.randn_like(v), torch.randn(h_shape, dtype=dtype)
    opts = dict(use_qk_l2norm_in_kernel=l2norm)
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_gated_delta_rule, inputs, d_o, d_state, **opts)
    o, s, grads = run_with_grads(chunk_gated_delta_rule_eager, inputs, d_o, d_state, chunk_size=chunk_size, **opts)
    tol = TOL[dtype]
    assert o.dtype == dtype and s.dtype == dtype
    assert_close(o, o_ref, tol, "output")
    assert_close(s, s_ref, tol, "final state")
    names = ["q", "k", "v", "g", "beta", "initial_state"][: len(grads)]
    for name, got, want in zip(names, grads, g_ref):
        assert_close(got, want, 5 * tol, f"grad {name}")


def test_equal_heads_and_custom_scale():
    q, k, v, g, beta, h0 = make_inputs(seq_len=20, k_heads=3, v_heads=3, dtype=torch.float64)
    kw = dict(scale=0.37, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o, s = chunk_gated_delta_rule_eager(q, k, v, g, beta, chunk_size=8, **kw)
    assert_close(o, o_ref, 1e-10, "output")
    assert_close(s, s_ref, 1e-10, "final state")


def test_grouped_heads_use_repeat_interleave_mapping():
    """Value head h must read key head h // (Hv // Hk): equal to expanding q/k by repeat_interleave."""
    q, k, v, g, beta, h0 = make_inputs(seq_len=12, k_heads=2, v_heads=6, dtype=torch.float64)
    kw = dict(chunk_size=4, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_gated_delta_rule_eager(q, k, v, g, beta, **kw)
    q3, k3 = (t.repeat_interleave(3, dim=2) for t in (q, k))
    o_rep, s_rep = chunk_gated_delta_rule_eager(q3, k3, v, g, beta, **kw)
    assert_close(o, o_rep, 1e-12, "output")
    assert_close(s, s_rep, 1e-12, "state")
    q_tiled, k_tiled = (t.repeat(1, 1, 3, 1) for t in (q, k))  # the other mapping must differ
    o_tiled, _ = chunk_gated_delta_rule_eager(q_tiled, k_tiled, v, g, beta, **kw)
    assert rel_err(o_tiled, o) > 1e-3


def test_short_sequence_shorter_than_one_chunk():
    q, k, v, g, beta, h0 = make_inputs(seq_len=3, dtype=torch.float64)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o, s = chunk_gated_delta_rule_eager(q, k, v, g, beta, chunk_size=64, **kw)
    assert_close(o, o_ref, 1e-10, "output")
    assert_close(s, s_ref, 1e-10, "final state")


def test_final_state_only_when_requested():
    q, k, v, g, beta, _ = make_inputs(seq_len=5)
    assert chunk_gated_delta_rule_eager(q, k, v, g, beta, chunk_size=4)[1] is None
    assert naive_recurrent_gated_delta_rule(q, k, v, g, beta)[1] is None


# ----------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_bf16_inputs_close_to_fp32_oracle(chunk_size):
    inputs = make_inputs(seq_len=45, dtype=torch.float32)
    bf16_inputs = [t.to(torch.bfloat16) if i < 5 else t for i, t in enumerate(inputs)]  # state stays fp32
    d_o, d_state = torch.randn_like(inputs[2]), torch.randn_like(inputs[5])
    opts = dict(use_qk_l2norm_in_kernel=True)
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_gated_delta_rule, inputs, d_o, d_state, **opts)
    o, s, grads = run_with_grads(
        chunk_gated_delta_rule_eager, bf16_inputs, d_o, d_state, chunk_size=chunk_size, **opts
    )
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    for name, got, want in zip(["output", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], [o, s, *grads],
                               [o_ref, s_ref, *g_ref]):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) <= 1e-2, f"{name}: relative L2 {rel_err(got, want):.3e}"


# ----------------------------------------------------------------------------- summaries


def explicit_transition(k, g, beta, l2norm):
    """Per-token product of exp(g_t)(I - beta_t k_t k_t^T), later tokens on the left (tiny T only)."""
    kh = inputs.expand_key_heads(l2_normalize(k) if l2norm else k, g.shape[2])
    key_dim = k.shape[-1]
    m = torch.eye(key_dim, dtype=k.dtype).expand(*g.shape[::2], key_dim, key_dim)
    for t in range(k.shape[1]):
        kt, bt, gt = kh[:, t], beta[:, t, :, None, None], g[:, t, :, None, None]
        m = gt.exp() * (torch.eye(key_dim, dtype=k.dtype) - bt * kt[..., :, None] * kt[..., None, :]) @ m
    return m


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_segment_summary_is_the_affine_map_of_the_sequence(chunk_size):
    q, k, v, g, beta, h0 = make_inputs(seq_len=29, dtype=torch.float64)
    M, S = gdn_segment_summary(k, v, g, beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=True)
    assert M.shape == (2, 4, 8, 8) and S.shape == (2, 4, 8, 6)
    assert_close(M, explicit_transition(k, g, beta, True), 1e-10, "M")
    for init in (h0, None):
        _, final = naive_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert_close(apply_summary(M, S, init), final, 1e-10, "M h0 + S")


def test_segment_summary_is_fp32_for_bf16_inputs():
    q, k, v, g, beta, _ = make_inputs(seq_len=10)
    M, S = gdn_segment_summary(*(t.bfloat16() for t in (k, v, g, beta)), chunk_size=4, use_qk_l2norm_in_kernel=True)
    assert M.dtype == torch.float32 and S.dtype == torch.float32


def split_sizes(seq_len, parts):
    """Random uneven positive segment lengths (CP shards need not be chunk multiples here)."""
    cuts = sorted((torch.randperm(seq_len - 1)[: parts - 1] + 1).tolist())  # torch RNG: replayable
    return [b - a for a, b in zip([0, *cuts], [*cuts, seq_len])]


def split(tensors, sizes):
    return list(zip(*(torch.split(t, sizes, dim=1) for t in tensors)))


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_composed_segment_summaries_give_the_whole_sequence(parts):
    q, k, v, g, beta, h0 = make_inputs(seq_len=41, dtype=torch.float64)
    kw = dict(use_qk_l2norm_in_kernel=True)
    o_full, s_full = chunk_gated_delta_rule_eager(
        q, k, v, g, beta, chunk_size=8, initial_state=h0, output_final_state=True, **kw
    )
    segments = split((q, k, v, g, beta), split_sizes(41, parts))
    summaries = [gdn_segment_summary(*seg[1:], chunk_size=8, **kw) for seg in segments]
    states = compose_summaries(summaries, h0)
    assert len(states) == parts + 1
    assert_close(states[0], h0, 0.0, "entering state of rank 0")
    assert_close(states[-1], s_full, 1e-10, "final state")
    # each rank, entered with its prefix state, reproduces its slice of the output (State-P2P forward)
    outs = [chunk_gated_delta_rule_eager(*seg, chunk_size=8, initial_state=h, **kw)[0] for seg, h in
            zip(segments, states)]
    assert_close(torch.cat(outs, dim=1), o_full, 1e-10, "stitched outputs")


def test_compose_summaries_order_matters():
    q, k, v, g, beta, h0 = make_inputs(seq_len=24, dtype=torch.float64)
    segments = split((k, v, g, beta), [9, 15])
    summaries = [gdn_segment_summary(*seg, chunk_size=4, use_qk_l2norm_in_kernel=True) for seg in segments]
    in_order = compose_summaries(summaries, h0)[-1]
    reversed_order = compose_summaries(summaries[::-1], h0)[-1]
    assert rel_err(reversed_order, in_order) > 1e-3
    m, s = combine_summaries(*summaries)
    assert_close(apply_summary(m, s, h0), in_order, 1e-12, "combine == compose")
    m_rev, _ = combine_summaries(*summaries[::-1])
    assert rel_err(m_rev, m) > 1e-3


def test_compose_summaries_without_initial_state_starts_from_zero():
    _, k, v, g, beta, _ = make_inputs(seq_len=16, dtype=torch.float64)
    M, S = gdn_segment_summary(k, v, g, beta, chunk_size=4)
    states = compose_summaries([(M, S)])
    assert torch.equal(states[0], torch.zeros_like(S)) and torch.equal(states[1], S)


def test_summary_tree_reduction_keeps_chunk_order():
    """Odd and even chunk counts (N = 9, 8, 6, 3, 1) tree-reduce to the same M, S as a
    left-to-right fold of the single-chunk summaries."""
    _, k, v, g, beta, _ = make_inputs(seq_len=36, dtype=torch.float64)
    for chunk_size in (4, 5, 7, 12, 36):
        M, S = gdn_segment_summary(k, v, g, beta, chunk_size=chunk_size)
        chunks = zip(*(torch.split(t, chunk_size, dim=1) for t in (k, v, g, beta)))  # last one may be short
        per_chunk = [gdn_segment_summary(*chunk, chunk_size=chunk_size) for chunk in chunks]
        m_fold, s_fold = per_chunk[0]
        for nxt in per_chunk[1:]:
            m_fold, s_fold = combine_summaries((m_fold, s_fold), nxt)
        assert_close(M, m_fold, 1e-10, f"M, chunk {chunk_size}")
        assert_close(S, s_fold, 1e-10, f"S, chunk {chunk_size}")


def test_segment_summary_gradients_match_recurrence():
    q, k, v, g, beta, h0 = make_inputs(seq_len=19, dtype=torch.float64)
    d_state = torch.randn_like(h0)

    def summary_route(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        M, S = gdn_segment_summary(k, v, g, beta, chunk_size=4, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return q.sum() * 0, apply_summary(M, S, initial_state)

    d_o = torch.zeros(())
    _, _, got = run_with_grads(summary_route, (q, k, v, g, beta, h0), d_o, d_state, use_qk_l2norm_in_kernel=True)
    _, _, want = run_with_grads(naive_recurrent_gated_delta_rule, (q, k, v, g, beta, h0),
                                torch.zeros_like(v), d_state, use_qk_l2norm_in_kernel=True)
    for name, a, b in zip(["k", "v", "g", "beta", "h0"], got[1:], want[1:]):
        assert_close(a, b, 1e-9, f"grad {name}")


# ----------------------------------------------------------------------------- state-gradient chain


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_state_gradient_chain_matches_autograd(parts):
    """dH_r = local_r + M_r^T dH_{r+1}, run from the last rank down, equals autograd's gradient
    w.r.t. every rank's entering state, including dH0 (nothing lost, order not reversed).
    Slow forgetting keeps the M^T dH_out term large enough for the negative checks to bite."""
    q, k, v, g, beta, h0 = make_inputs(seq_len=43, dtype=torch.float64, decay_bias=5.0, beta_max=0.3)
    kw = dict(chunk_size=8, use_qk_l2norm_in_kernel=True)
    d_o, d_final = torch.randn_like(v), torch.randn_like(h0)
    segments = split((q, k, v, g, beta), split_sizes(43, parts))
    d_o_parts = torch.split(d_o, [seg[0].shape[1] for seg in segments], dim=1)

    # autograd through a State-P2P-shaped forward, keeping every entering state's gradient
    h0_leaf = h0.clone().requires_grad_(True)
    summaries = [gdn_segment_summary(*seg[1:], **kw) for seg in segments]
    states = compose_summaries([(m.detach(), s.detach()) for m, s in summaries], h0_leaf)
    for h in states:
        h.retain_grad()
    outs = [chunk_gated_delta_rule_eager(*seg, initial_state=h, **kw)[0] for seg, h in zip(segments, states)]
    loss = sum((o * d).sum() for o, d in zip(outs, d_o_parts)) + (states[-1] * d_final).sum()
    loss.backward()

    local = [gdn_local_state_grad(seg[0], seg[1], seg[3], seg[4], d, **kw) for seg, d in zip(segments, d_o_parts)]
    chained = chain_state_grads(local, summaries, d_final)
    assert len(chained) == parts + 1
    for r in range(parts):
        assert_close(chained[r], states[r].grad, 1e-9, f"dH entering rank {r}")
    assert_close(chained[0], h0_leaf.grad, 1e-9, "dH0")

    # the same loss through one whole-sequence call: the chain's dH0 is the true initial-state grad
    h0_whole = h0.clone().requires_grad_(True)
    o_whole, s_whole = chunk_gated_delta_rule_eager(q, k, v, g, beta, initial_state=h0_whole,
                                                    output_final_state=True, **kw)
    (d_h0,) = torch.autograd.grad(((o_whole * d_o).sum() + (s_whole * d_final).sum()), h0_whole)
    assert_close(chained[0], d_h0, 1e-9, "dH0 vs whole sequence")

    # rank order reversed, or the M^T term dropped, must not reproduce it
    rev = chain_state_grads(local[::-1], summaries[::-1], d_final)
    assert rel_err(rev[0], d_h0) > 1e-3
    assert rel_err(local[0], d_h0) > 1e-3


def test_local_state_grad_matches_autograd_and_ignores_values():
    q, k, v, g, beta, h0 = make_inputs(seq_len=26, dtype=torch.float64)
    d_o = torch.randn_like(v)
    h = h0.clone().requires_grad_(True)
    o, _ = chunk_gated_delta_rule_eager(q, k, v, g, beta, chunk_size=8, initial_state=h, use_qk_l2norm_in_kernel=True)
    (want,) = torch.autograd.grad(o, h, d_o)
    got = gdn_local_state_grad(q, k, g, beta, d_o, chunk_size=8, use_qk_l2norm_in_kernel=True)
    assert_close(got, want, 1e-10, "local dH")
    assert_close(summary_adjoint(torch.eye(8, dtype=torch.float64).expand(2, 4, 8, 8), want), want, 0.0, "I^T x")


# ----------------------------------------------------------------------------- transformers references


def transformers_references():
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    # unwrap the hub/fla dispatch decorators: we want the torch fallbacks themselves
    return inspect.unwrap(qwen.torch_chunk_gated_delta_rule), inspect.unwrap(qwen.torch_recurrent_gated_delta_rule)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("l2norm", [True, False])
def test_matches_transformers_qwen3_5_torch_references(chunk_size, l2norm):
    hf_chunk, hf_recurrent = transformers_references()
    inputs = make_inputs(seq_len=45, k_dim=16, v_dim=16, l2norm=l2norm)
    d_o, d_state = torch.randn_like(inputs[2]), torch.randn_like(inputs[5])
    opts = dict(use_qk_l2norm_in_kernel=l2norm)

    def hf_chunk_fn(q, k, v, g, beta, **kw):
        return hf_chunk(q, k, v, g=g, beta=beta, chunk_size=chunk_size, **kw)

    def hf_recurrent_fn(q, k, v, g, beta, **kw):
        return hf_recurrent(q, k, v, g=g, beta=beta, **kw)

    o, s, grads = run_with_grads(chunk_gated_delta_rule_eager, inputs, d_o, d_state, chunk_size=chunk_size, **opts)
    for ref_fn in (hf_chunk_fn, hf_recurrent_fn):
        o_ref, s_ref, g_ref = run_with_grads(ref_fn, inputs, d_o, d_state, **opts)
        assert_close(o, o_ref, 2e-5, "output")
        assert_close(s, s_ref, 2e-5, "final state")
        for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], grads, g_ref):
            assert_close(a, b, 1e-4, f"grad {name}")


# ----------------------------------------------------------------------------- gradcheck


def test_gradcheck_chunk_form_float64():
    q, k, v, g, beta, h0 = make_inputs(batch=1, seq_len=7, k_heads=1, v_heads=2, k_dim=3, v_dim=2,
                                       dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]

    def fn(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule_eager(q, k, v, g, beta, chunk_size=4, initial_state=h0,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)

    assert torch.autograd.gradcheck(fn, leaves)


def test_gradcheck_segment_summary_float64():
    _, k, v, g, beta, _ = make_inputs(batch=1, seq_len=7, k_heads=1, v_heads=2, k_dim=3, v_dim=2,
                                      dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (k, v, g, beta)]
    assert torch.autograd.gradcheck(lambda *x: gdn_segment_summary(*x, chunk_size=3), leaves)


# ----------------------------------------------------------------------------- contract


def test_rejects_bad_shapes_with_named_cause():
    q, k, v, g, beta, h0 = make_inputs(seq_len=8, k_heads=3, v_heads=4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_rule_eager(q, k, v, g, beta)
    q, k, v, g, beta, h0 = make_inputs(seq_len=8)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule_eager(q, k, v, g, beta, initial_state=h0[:, :2])
    with pytest.raises(ValueError, match="beta"):
        naive_recurrent_gated_delta_rule(q, k, v, g, beta[:, :4])
    with pytest.raises(ValueError, match="chunk_size"):
        gdn_segment_summary(k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="local gradient per summary"):
        chain_state_grads([], [])


def test_module_never_imports_triton():
    for module in (eager, inputs, naive, summary):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(name.split(".")[0] == "triton" for name in imported), module.__name__
