"""Qwen3.5 adapter: identities, parameter roles, the GDN layer statement vs transformers, custom ops."""
from __future__ import annotations

import pytest
import torch

from cp_harness import rel
from gdn_harness import CHUNK, DECAY_PARAMS, TEXT, gdn_layer, tiny_qwen3_5, tiny_qwen3_5_vl
from cpcompile.adapters.qwen3_5 import GDN_PARAMETER_ROLES, gdn_layer_forward, is_gdn_layer, is_qwen3_5

@pytest.mark.parametrize("make", [tiny_qwen3_5, tiny_qwen3_5_vl], ids=["causal_lm", "conditional_generation"])
def test_both_identities_are_recognised_with_their_gdn_layers(make):
    model = make(0)
    assert is_qwen3_5(model)
    layers = [name for name, m in model.named_modules() if is_gdn_layer(m)]
    assert len(layers) == 3 and all(name.endswith("linear_attn") for name in layers)
    layer = model.get_submodule(layers[0])
    assert all(hasattr(layer, name) for name in GDN_PARAMETER_ROLES)


def _layer_and_grads(layer, forward, hidden, mask, weight):
    out = forward(layer, hidden, mask)
    grads = torch.autograd.grad((out * weight).sum(), list(layer.parameters()))
    return out, dict(zip([n for n, _ in layer.named_parameters()], grads))


def test_layer_statement_matches_transformers():
    """Output and gradients equal transformers' fp32 path; for the decay parameters, whose
    fp32 gradients are ill-conditioned, ours is at least as close to a float64 truth."""
    holder = gdn_layer(1, torch.float32)
    layer = holder.layer
    hidden = torch.randn(2, 21, TEXT["hidden_size"])
    weight = torch.randn_like(hidden)
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, :4] = 0
    ours = lambda m, h, a: gdn_layer_forward(m, h, a, chunk_size=CHUNK, backend="eager")
    theirs = lambda m, h, a: m(h, attention_mask=a)
    out, grads = _layer_and_grads(layer, ours, hidden, mask, weight)
    hf_out, hf_grads = _layer_and_grads(layer, theirs, hidden, mask, weight)
    truth_out, truth = _layer_and_grads(layer.double(), ours, hidden.double(), mask, weight.double())
    assert rel(out, hf_out) <= 1e-5
    assert (out[1, :4] == 0).all(), "padded positions must output exactly zero"
    for name, grad in grads.items():
        if name.endswith(DECAY_PARAMS):
            assert rel(grad, truth[name]) <= 10 * rel(hf_grads[name], truth[name]) + 1e-6, name
        else:
            assert rel(grad, hf_grads[name]) <= 1e-5, name


def _gdn_inputs(dtype=torch.float64, length=10, with_state=True):
    b, hk, hv, k, v = 1, 2, 4, 8, 8
    q = torch.nn.functional.normalize(torch.randn(b, length, hk, k, dtype=dtype), dim=-1).requires_grad_()
    key = torch.nn.functional.normalize(torch.randn(b, length, hk, k, dtype=dtype), dim=-1).requires_grad_()
    val = torch.randn(b, length, hv, v, dtype=dtype, requires_grad=True)
    g = (-torch.rand(b, length, hv, dtype=dtype)).requires_grad_()
    beta = torch.rand(b, length, hv, dtype=dtype).requires_grad_()
    state = torch.randn(b, hv, k, v, dtype=dtype, requires_grad=True) if with_state else None
    return q, key, val, g, beta, state


@pytest.mark.parametrize("with_state", [True, False])
def test_gdn_chunk_op_passes_opcheck_and_gradcheck(with_state):
    q, k, v, g, beta, state = _gdn_inputs(with_state=with_state)
    torch.library.opcheck(torch.ops.cpcompile.gdn_chunk.default, (q, k, v, g, beta, state, 0.35, 4, "eager"))
    inputs = tuple(x for x in (q, k, v, g, beta, state) if x is not None)
    if with_state:
        fn = lambda *a: torch.ops.cpcompile.gdn_chunk(*a, 0.35, 4, "eager")
    else:
        fn = lambda *a: torch.ops.cpcompile.gdn_chunk(*a, None, 0.35, 4, "eager")
    assert torch.autograd.gradcheck(fn, inputs)


def test_gdn_summary_op_passes_opcheck_and_gradcheck():
    _, k, v, g, beta, _ = _gdn_inputs()
    torch.library.opcheck(torch.ops.cpcompile.gdn_summary.default, (k, v, g, beta, 4, "eager"))
    assert torch.autograd.gradcheck(lambda *a: torch.ops.cpcompile.gdn_summary(*a, 4, "eager"), (k, v, g, beta))


def test_summary_and_state_input_reproduce_one_pass():
    """Two segments through the ops (summary → entering state → output) equal one pass."""
    q, k, v, g, beta, _ = _gdn_inputs(dtype=torch.float64, length=20, with_state=False)
    whole = torch.ops.cpcompile.gdn_chunk(q, k, v, g, beta, None, 0.35, 8, "eager")
    first = slice(0, 11)
    m, s = torch.ops.cpcompile.gdn_summary(k[:, first], v[:, first], g[:, first], beta[:, first], 8, "eager")
    second = slice(11, 20)
    out = torch.ops.cpcompile.gdn_chunk(q[:, second], k[:, second], v[:, second], g[:, second], beta[:, second],
                                        s, 0.35, 8, "eager")
    assert rel(out, whole[:, second]) <= 1e-12
    assert m.shape == (1, 4, 8, 8)


def test_qwen3_next_layer_is_a_gdn_layer_and_its_statement_matches_transformers():
    """Qwen3-Next's GatedDeltaNet fuses its projections per key head (in_proj_qkvz, in_proj_ba);
    the adapter's statement of it equals transformers' forward, padding included (to fp32 rounding:
    transformers' torch core computes in fp32 whatever the input's dtype)."""
    from model_zoo import build

    model = build("qwen3_next", 0, torch.float64, mlp_only_layers=[0, 1])
    layer = model.model.layers[0].linear_attn
    assert type(layer).__name__ == "Qwen3NextGatedDeltaNet" and is_gdn_layer(layer)
    assert not is_gdn_layer(model.model.layers[1].self_attn)
    hidden = torch.randn(2, 21, 32, dtype=torch.float64)
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, :4] = 0
    ours = gdn_layer_forward(layer, hidden, mask, chunk_size=CHUNK, backend="eager")
    assert rel(ours, layer(hidden, attention_mask=mask)) <= 1e-5


def test_compiled_layer_runs_the_conv_as_taps_and_equals_eager():
    """Under torch.compile the layer's causal conv is `conv_taps` (no convolution op in the
    graph, so inductor can fuse it) and the core gets q, k and v contiguous; output, input and
    parameter gradients equal the eager layer's F.conv1d in float64, padding mask included."""
    import torch._dynamo

    layer = gdn_layer(3, torch.float64).layer
    hidden = torch.randn(2, 19, TEXT["hidden_size"], dtype=torch.float64)
    weight = torch.randn_like(hidden)
    mask = torch.ones(2, 19, dtype=torch.long)
    mask[0, :3] = 0
    seen = []

    core_inputs_contiguous = []

    def recording_backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        core_inputs_contiguous.extend([arg.meta["example_value"].is_contiguous() for arg in node.args[:3]]
                                      for node in gm.graph.nodes if "gdn_chunk" in str(node.target))
        return gm.forward

    def run(h, m):
        return gdn_layer_forward(layer, h, m, chunk_size=CHUNK, backend="eager")

    torch._dynamo.reset()
    inputs = [hidden.clone().requires_grad_() for _ in range(2)]
    eager = run(inputs[0], mask)
    compiled = torch.compile(run, backend=recording_backend, fullgraph=True)(inputs[1], mask)
    assert seen and not any("conv" in target for target in seen), seen
    assert core_inputs_contiguous == [[True] * 3], core_inputs_contiguous  # q, k, v: no copy in the core
    assert rel(compiled, eager) <= 1e-12
    params = list(layer.parameters())
    eager_grads = torch.autograd.grad((eager * weight).sum(), [inputs[0], *params])
    compiled_grads = torch.autograd.grad((compiled * weight).sum(), [inputs[1], *params])
    for want, got in zip(eager_grads, compiled_grads):
        assert rel(got, want) <= 1e-12


@pytest.mark.gpu
def test_gpu_inductor_layer_with_conv_taps_is_as_accurate_as_eager_in_bfloat16():
    """On CUDA, the layer compiled with inductor (its conv as fused taps) in bfloat16, judged
    against the float32 eager layer as cpcompile/parity.py judges CP: output, input and parameter
    gradients within 1.5x the eager bfloat16 layer's error (F.conv1d); the decay parameters'
    gradients as the CP tests judge them (gdn_harness.decay_as_close_as_reference's bound)."""
    from cpcompile.parity import relative_error, within_precision

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    reference = gdn_layer(4, torch.float32).layer.cuda()
    low = gdn_layer(4, torch.float32).layer.cuda().bfloat16()
    hidden = torch.randn(1, 1024, TEXT["hidden_size"], device="cuda")
    weight = torch.randn_like(hidden)

    def run(layer, h, compiled=False):
        h = h.detach().requires_grad_()
        forward = lambda x: gdn_layer_forward(layer, x, None, chunk_size=CHUNK, backend="eager")
        out = (torch.compile(forward, backend="inductor") if compiled else forward)(h)
        grads = torch.autograd.grad((out.float() * weight).sum(), [h, *layer.parameters()])
        return [out.float(), *(g.float() for g in grads)]

    truth, eager, compiled = run(reference, hidden), run(low, hidden.bfloat16()), run(low, hidden.bfloat16(), True)
    names = ["output", "input", *(name for name, _ in low.named_parameters())]
    for name, t, e, c in zip(names, truth, eager, compiled):
        got, bound = relative_error(c, t), relative_error(e, t)
        if name.endswith(DECAY_PARAMS):  # sums of cancelling terms: the CP tests' decay bound
            assert got <= 10 * bound + 1e-4, (name, got, bound)
        else:
            assert within_precision(got, bound), (name, got, bound)
