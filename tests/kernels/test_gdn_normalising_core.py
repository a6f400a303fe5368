"""The eager CUDA GDN layer's core with its q/k L2 norm inside (`kernels/gdn/normalising_core.py`)
against the layer as Qwen3.5 states it (the fp32 norm, then `cpcompile::gdn_chunk`): output, input
gradient and every parameter gradient, unpacked, padded and packed.

On the CPU the path is forced (it applies to CUDA tensors only) and the kernels run in Triton's
interpreter, in float32: the two forms are the same computation, so they agree to rounding. On a GPU
it is judged in bfloat16 against the float32 layer, as cpcompile/parity.py judges CP."""
from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")

from cp_harness import rel  # noqa: E402
from gdn_harness import DECAY_PARAMS, TEXT  # noqa: E402

from cpcompile.adapters import qwen3_5  # noqa: E402
from cpcompile.kernels.gdn import CHUNK_SIZE, normalising_core  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")


def _layer(seed: int, head_dim: int, device: str = "cpu"):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**{**TEXT, "linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim,
                                  "linear_num_key_heads": 2, "linear_num_value_heads": 4})
    return Qwen3_5GatedDeltaNet(config, layer_idx=0).to(device)


@torch.no_grad()
def _correlated_layer(seed: int, no_decay: bool = False):
    """A head-size-16 layer whose key projections are nearly parallel; `no_decay`: A_log = -30."""
    layer = _layer(seed, 16)
    keys = layer.in_proj_qkv.weight[layer.key_dim: 2 * layer.key_dim]
    keys.copy_(keys[:1] + 0.05 * keys)
    if no_decay:
        layer.A_log.fill_(-30.0)
    return layer


def _case(name: str, batch: int, length: int, device: str, seed: int):
    """-> (attention mask or None, document positions or None) of a layout."""
    gen = torch.Generator().manual_seed(seed)
    if name == "padded":
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, : int(torch.randint(1, length // 3, (), generator=gen))] = 0  # left padding
        return mask.to(device), None
    if name == "packed":  # documents of random lengths, a one-token document among them
        cuts = sorted(torch.randperm(length - 2, generator=gen)[:5].add(1).tolist() + [length - 1])
        positions, start = torch.empty(length, dtype=torch.long), 0
        for cut in cuts + [length]:
            positions[start:cut] = torch.arange(cut - start)
            start = cut
        return None, positions[None].to(device)
    return None, None


def _run(layer, hidden, weight, mask, positions, patch, force: bool | None = None, backend: str = "triton"):
    """-> (output, input and parameter gradients in float32, whether the layer took the path);
    `force`: take it (True) or not (False), or leave it to `applies` (None)."""
    if force is not None:
        patch.setattr(normalising_core, "applies", lambda x, backend: force)
    taken, chunk = [], normalising_core.chunk_normalising_qk
    patch.setattr(normalising_core, "chunk_normalising_qk", lambda *a, **k: taken.append(1) or chunk(*a, **k))
    h = hidden.detach().clone().requires_grad_()
    out = qwen3_5.gdn_layer_forward(layer, h, mask, positions, chunk_size=CHUNK_SIZE, backend=backend)
    grads = torch.autograd.grad((out.float() * weight).sum(), [h, *layer.parameters()])
    patch.setattr(normalising_core, "chunk_normalising_qk", chunk)
    return [out.float(), *(g.float() for g in grads)], bool(taken)


@cpu_only
@pytest.mark.parametrize("layout", ["unpacked", "padded", "packed"])
def test_norm_in_the_core_equals_the_stated_layer(monkeypatch, layout):
    """fp32 in the interpreter: within 1e-5 of the stated layer, the decay parameters' gradients
    (sums of cancelling terms) within 1e-4. Correlated keys make any misplaced norm show: the
    norm of nearly parallel keys is what keeps the chunk inverse well-conditioned."""
    seed = random.randrange(1 << 30)
    layer = _correlated_layer(seed % 1000)
    batch = 1 if layout == "packed" else 2
    hidden = torch.randn(batch, 2 * CHUNK_SIZE + 11, TEXT["hidden_size"]) * 3  # not a chunk multiple
    weight = torch.randn(batch, hidden.shape[1], TEXT["hidden_size"])
    mask, positions = _case(layout, batch, hidden.shape[1], "cpu", seed)
    stated, took_stated = _run(layer, hidden, weight, mask, positions, monkeypatch, force=False)
    fused, took_fused = _run(layer, hidden, weight, mask, positions, monkeypatch, force=True)
    assert took_fused and not took_stated
    names = ["output", "input", *(name for name, _ in layer.named_parameters())]
    for name, want, got in zip(names, stated, fused):
        bound = 1e-4 if name.endswith(DECAY_PARAMS) else 1e-5
        assert rel(got, want) <= bound, (layout, name, rel(got, want), seed)
    if mask is not None:
        assert (fused[0][mask == 0] == 0).all(), "padded positions must output exactly zero"


@cpu_only
@pytest.mark.parametrize("layout", ["unpacked", "packed"])
def test_norm_in_the_core_without_decay_against_float64(monkeypatch, layout):
    """No decay (A_log = -30: every gate ~1, the state never forgets) and nearly parallel keys,
    judged against the eager float64 layer rather than against the other fp32 form: the fp32 path
    with the norm in the core may be at most 1.5x as far from float64 as the stated fp32 path (the
    decay parameters' gradients 10x, as on the GPU), plus 1e-6 for rounding."""
    seed = random.randrange(1 << 30)
    layer = _correlated_layer(seed % 1000, no_decay=True)
    batch = 1 if layout == "packed" else 2
    hidden = torch.randn(batch, 2 * CHUNK_SIZE + 11, TEXT["hidden_size"]) * 3
    weight = torch.randn(batch, hidden.shape[1], TEXT["hidden_size"])
    mask, positions = _case(layout, batch, hidden.shape[1], "cpu", seed)
    h = hidden.double().requires_grad_()
    double = _layer(seed % 1000, 16).double()
    double.load_state_dict(layer.state_dict())
    out = qwen3_5.gdn_layer_forward(double, h, mask, positions, chunk_size=CHUNK_SIZE, backend="eager")
    truth = [out, *torch.autograd.grad((out * weight.double()).sum(), [h, *double.parameters()])]
    stated, _ = _run(layer, hidden, weight, mask, positions, monkeypatch, force=False)
    fused, took = _run(layer, hidden, weight, mask, positions, monkeypatch, force=True)
    assert took
    names = ["output", "input", *(name for name, _ in layer.named_parameters())]
    for name, t, s, f in zip(names, truth, stated, fused):
        got, bound = rel(f, t), rel(s, t)
        factor = 10 if name.endswith(DECAY_PARAMS) else 1.5  # decay gradients: sums of cancelling terms
        assert got <= factor * bound + 1e-6, (layout, name, got, bound, seed)


def test_only_the_untraced_cuda_layer_takes_it():
    """The eager CUDA layer on the triton backend; never the eager backend, a CPU tensor, or a
    traced call (a CP rewrite must find `cpcompile::gdn_chunk` in its graph)."""
    assert not normalising_core.applies(torch.zeros(1), "triton")
    if torch.cuda.is_available():
        cuda = torch.zeros(1, device="cuda")
        assert normalising_core.applies(cuda, "triton")
        assert not normalising_core.applies(cuda, "eager")
        traced = torch.compile(lambda x: x + 1 if normalising_core.applies(x, "triton") else x - 1,
                               backend="eager", fullgraph=True)
        assert traced(cuda).item() == -1


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["unpacked", "padded", "packed"])
def test_gpu_norm_in_the_core_is_as_accurate_in_bfloat16(layout):
    """On CUDA in bfloat16 against the float32 layer (stated form, eager core: fp32 Triton dots may
    round through TF32, which would blur the reference): output,
    input and parameter gradients within 1.5x the stated bf16 layer's error (cpcompile/parity.py),
    the decay parameters' gradients within 10x (the CP tests' decay bound)."""
    from cpcompile.parity import relative_error, within_precision

    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs CUDA")
    seed = random.randrange(1 << 30)
    reference = _layer(seed % 1000, 128, "cuda")
    low = _layer(seed % 1000, 128, "cuda").bfloat16()
    batch = 1 if layout == "packed" else 2
    hidden = torch.randn(batch, 4096 + 37, TEXT["hidden_size"], device="cuda")
    weight = torch.randn_like(hidden)
    mask, positions = _case(layout, batch, hidden.shape[1], "cuda", seed)
    with pytest.MonkeyPatch.context() as patch:
        truth, _ = _run(reference, hidden, weight, mask, positions, patch, force=False, backend="eager")
        stated, _ = _run(low, hidden.bfloat16(), weight, mask, positions, patch, force=False)
    with pytest.MonkeyPatch.context() as patch:
        fused, took = _run(low, hidden.bfloat16(), weight, mask, positions, patch)  # as `applies` decides
    assert took, "the eager CUDA layer did not take the core with the norm inside"
    names = ["output", "input", *(name for name, _ in low.named_parameters())]
    for name, t, s, f in zip(names, truth, stated, fused):
        got, bound = relative_error(f, t), relative_error(s, t)
        print(f"normalising core {layout} {name}: bf16 {got:.2e}, stated bf16 {bound:.2e}")
        if name.endswith(DECAY_PARAMS):
            assert got <= 10 * bound + 1e-4, (name, got, bound, seed)
        else:
            assert within_precision(got, bound), (name, got, bound, seed)
