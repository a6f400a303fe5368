"""Without CP the trainer runs a model's softmax attention on the CP regions' local kernels
(`adapters/hf_attention.py`), so that packed and padded batches build no S x S mask: the same
logits (at real tokens), loss and every parameter gradient as transformers' own SDPA path with its
dense mask, in float64, for unpadded, right-padded, left-padded and packed batches. A right-padded
batch runs the unmasked kernel (its padding lies after every real query), the others the masked one."""
from __future__ import annotations

import copy

import pytest
import torch

from cp_harness import VOCAB, tiny_llama, tiny_qwen3
from cpcompile.adapters.hf_attention import local_attention_forward, route_attention, route_attention_without_cp
from cpcompile.documents import causally_unmasked_keys, mark_unmasked, positions_from_starts
from cpcompile.errors import CPInputError, UnsupportedError
from cpcompile.trainer.parallelize import decoder_layers

S = 24


def batch(kind: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, S), generator=gen)
    positions = torch.arange(S).expand(2, S).clone()
    mask = None
    if kind == "right_padded":
        mask = torch.ones(2, S, dtype=torch.long)
        mask[0, -5:] = 0
    elif kind == "left_padded":
        mask = torch.ones(2, S, dtype=torch.long)
        mask[1, :7] = 0
    elif kind == "packed":
        starts = torch.zeros(2, S, dtype=torch.bool)
        starts[:, 0] = True
        starts[0, [5, 6, 17]] = True  # a one-token document too
        starts[1, [11]] = True
        positions = torch.stack([positions_from_starts(row) for row in starts])
    out = {"input_ids": ids, "position_ids": positions}
    if mask is not None:
        out["attention_mask"] = mask
    return out


def run(model, inputs: dict, unmasked: bool | None):
    inputs = {k: v.clone() for k, v in inputs.items()}
    if unmasked is not None:
        mark_unmasked(inputs["position_ids"], unmasked)
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    real = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
    loss = (logits.float().log_softmax(-1)[..., 0] * real).sum()  # every real token's output counts
    loss.backward()
    return logits[real], loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["unpadded", "right_padded", "left_padded", "packed"])
def test_local_kernels_match_transformers_sdpa(build, kind, monkeypatch):
    import cpcompile.kernels.attention.local as local

    paths = []
    for name in ("chunk_attention", "tiled_attention"):
        kernel = getattr(local, name)
        monkeypatch.setattr(local, name, lambda *a, _k=kernel, _n=name, **kw: paths.append(_n) or _k(*a, **kw))
    reference = build(seed=3).double()
    routed = copy.deepcopy(reference)
    assert route_attention_without_cp(routed, decoder_layers(routed)) == len(decoder_layers(routed))
    inputs = batch(kind, seed=len(kind))
    unmasked = causally_unmasked_keys(inputs["position_ids"], inputs.get("attention_mask"))
    assert unmasked == (kind in ("unpadded", "right_padded"))  # right padding: after every real query
    want_logits, want_loss, want_grads = run(reference, inputs, None)
    got_logits, got_loss, got_grads = run(routed, inputs, unmasked)
    assert set(paths) == {"chunk_attention" if unmasked else "tiled_attention"}, paths
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-10, atol=1e-10)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-8, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", ["gpt_neox", "falcon", "phi3", "deepseek_v3"])
def test_other_architectures_match_too(name):
    """Other attention layouts: GPT-NeoX's fused QKV, Falcon's one KV head, Phi-3, and DeepSeek-V3's
    latent attention, whose value head size differs from the query's (zero-padded for the kernels)."""
    from model_zoo import build

    dense = {"first_k_dense_replace": 2} if name == "deepseek_v3" else {}  # its MoE's grouped matmul takes no float64
    reference = build(name, seed=9, **dense).double()
    routed = copy.deepcopy(reference)
    route_attention(routed)
    for kind in ("right_padded", "packed"):
        inputs = batch(kind, seed=11)
        want_logits, want_loss, want_grads = run(reference, inputs, None)
        got_logits, got_loss, got_grads = run(routed, inputs, None)
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-10, atol=1e-10)
        for grad_name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[grad_name], grad, rtol=1e-8, atol=1e-10)


def test_a_wrong_unmasked_fact_is_caught():
    """Negative control: told a packed batch is unmasked, the kernel attends across documents, and the
    comparison above fails."""
    reference = tiny_qwen3(seed=4).double()
    routed = copy.deepcopy(reference)
    route_attention_without_cp(routed, decoder_layers(routed))
    inputs = batch("packed", seed=5)
    want, _, _ = run(reference, inputs, None)
    got, _, _ = run(routed, inputs, True)
    assert (got - want).abs().max() > 1e-3


def test_no_square_mask_reaches_the_kernel(monkeypatch):
    """What transformers hands the attention is the 2-D padding mask, never a [B, 1, S, S] one."""
    from cpcompile.adapters import hf_attention

    seen = []
    original = hf_attention.local_attention_forward

    def spy(module, q, k, v, attention_mask, *args, **kwargs):
        seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        return original(module, q, k, v, attention_mask, *args, **kwargs)

    monkeypatch.setattr(hf_attention, "local_attention_forward", spy)
    model = tiny_qwen3(seed=6).double()
    route_attention(model)
    for kind in ("right_padded", "packed"):
        model(**batch(kind, seed=7), use_cache=False)
    assert seen == [(2, S)] * 2 + [None] * 2


def test_sliding_windows_are_refused():
    model = tiny_qwen3(seed=8, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(UnsupportedError, match="sliding window"):
        route_attention(model)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(dropout=0.1, position_ids=torch.arange(4)[None]), CPInputError, "dropout"),
    (dict(position_ids=None), UnsupportedError, "without position ids"),
    (dict(position_ids=torch.arange(4)[None], sliding_window=2), UnsupportedError, "sliding window"),
])
def test_calls_it_cannot_compute_are_refused(kwargs, error, words):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(error, match=words):
        local_attention_forward(torch.nn.Module(), q, q, q, None, **kwargs)


def test_under_autocast_the_kernels_get_q_k_v_at_its_dtype(monkeypatch):
    """As SDPA under autocast: Qwen3's rotary hands fp32 Q and K beside a bf16 V (on CUDA an fp32
    query would pick FlexAttention, whose backward refuses mixed dtypes); all three reach the kernel
    in bf16, and the logits stay within bf16 rounding of transformers' own path."""
    import cpcompile.adapters.hf_attention as adapter

    seen = []
    kernel = adapter.local_attention
    monkeypatch.setattr(adapter, "local_attention",
                        lambda q, k, v, *a: seen.append((q.dtype, k.dtype, v.dtype)) or kernel(q, k, v, *a))
    reference = tiny_qwen3(seed=5)
    routed = copy.deepcopy(reference)
    route_attention_without_cp(routed, decoder_layers(routed))
    inputs = batch("packed", seed=9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(**inputs, use_cache=False).logits.float()
        got = routed(**inputs, use_cache=False).logits.float()
    assert seen and set(seen) == {(torch.bfloat16,) * 3}, seen
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
