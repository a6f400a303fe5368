"""`cpcompile::gdn_conv`, the GDN layer's causal depthwise conv + SiLU on Triton kernels, against a
float64 oracle (`conv_taps`, then SiLU; `F.conv1d` agrees with it without positions): the output
and the gradients of the input (its halo rows included), the weight and the bias; with and
without positions (one-token documents, a document starting at the halo's edge, one continuing
through it), B = 2, several channel blocks and token programs. A negative control: the oracle
without positions is far from the kernel with them. And the Qwen3.5 layer with the kernel wired in
(forced on the CPU interpreter) matches the layer on `F.conv1d`.

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from cpcompile.kernels.gdn import conv as conv_module  # noqa: E402  (registers cpcompile::gdn_conv)
from cpcompile.kernels.gdn.conv import conv_taps  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")
KERNEL, BATCH, LENGTH, CHANNELS = 4, 2, 19, 20


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough that the shapes span several channel blocks and token tiles, and the
    backward sums dw over several programs of several tiles each."""
    from cpcompile.kernels.gdn.triton import conv as kernels

    monkeypatch.setattr(kernels, "CONV_BT", {"fwd": 8, "bwd": 8})
    monkeypatch.setattr(kernels, "CONV_BC", {"fwd": 16, "bwd": 16})
    monkeypatch.setattr(kernels, "BWD_TARGET_PROGRAMS", 6)  # 2 x 2 programs of 2 tiles (3 in T)


def oracle(x, weight, bias, positions, halo: bool, silu: bool = True):
    """float64: `conv_taps` on the history `[B, C, T + K - 1]` (zeros in front without `halo`), SiLU."""
    history = x.double().transpose(1, 2)
    if not halo:
        history = F.pad(history, (weight.shape[-1] - 1, 0))
    out = conv_taps(history, weight.double(), None if bias is None else bias.double(), positions).transpose(1, 2)
    return F.silu(out) if silu else out


def positions_of(case: str) -> torch.Tensor | None:
    """Row 0: one-token documents (4, 5, 6), a document starting at token 0 (the halo's edge: it is
    never read), one starting at 1 (reads token 0, not the halo). Row 1: a document continuing from
    the halo (positions 2.. at token 0: the halo read partly), then one starting at 7."""
    if case == "none":
        return None
    row0 = [0, 0, 1, 2, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    row1 = [2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    return torch.tensor([row0, row1])


def _inputs(halo: bool, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    length = LENGTH + (KERNEL - 1 if halo else 0)
    x = torch.randn(BATCH, length, CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, 1, KERNEL, generator=gen) / 2
    b = torch.randn(CHANNELS, generator=gen) if bias else None
    grad = torch.randn(BATCH, LENGTH, CHANNELS, generator=gen)
    return x, weight, b, grad


def _run(fn, x, weight, bias, grad):
    leaves = [t.clone().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
    out = fn(*leaves[:2], leaves[2] if bias is not None else None)
    grads = torch.autograd.grad((out * grad.to(out.dtype)).sum(), leaves)
    return [out, *grads]


def _max_err(ours, truth) -> float:
    return max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, truth))


@cpu_only
@pytest.mark.parametrize("halo, case, bias", [(False, "none", True), (True, "documents", True),
                                              (False, "documents", False), (True, "none", False)],
                         ids=["zeros-bias", "halo-documents-bias", "zeros-documents", "halo"])
def test_conv_and_every_gradient_match_the_float64_oracle(small_tiles, halo, case, bias):
    """fp32 kernels within 1e-5 (relative to each tensor's largest entry) of the float64 oracle:
    output, dx (halo rows included), dw and db summed over B and T. Each of halo, positions and
    bias present and absent (the interpreter is slow: not their full product)."""
    x, weight, b, grad = _inputs(halo, bias)
    positions = positions_of(case)
    ours = _run(lambda x, w, b: torch.ops.cpcompile.gdn_conv(x, w, b, positions, True, halo), x, weight, b, grad)
    truth = _run(lambda x, w, b: oracle(x, w, b, positions, halo), x.double(), weight.double(),
                 None if b is None else b.double(), grad.double())
    assert ours[0].dtype == x.dtype and ours[0].is_contiguous() and ours[1].shape == x.shape
    assert _max_err(ours, truth) < 1e-5


@cpu_only
def test_without_silu_a_halo_and_a_channel_major_history(small_tiles, monkeypatch):
    """`causal_conv` on the triton backend (as a CP region calls it on CUDA; forced here): the
    `[B, C, T + K - 1]` history read through a transposed view, no SiLU; agrees with `F.conv1d` in
    float64. Backward token tiles of 2, fewer than the halo's 3 rows."""
    from cpcompile.kernels.gdn.triton import conv as kernels

    monkeypatch.setattr(kernels, "CONV_BT", {"fwd": 8, "bwd": 2})
    calls = []
    monkeypatch.setattr(conv_module, "triton_conv_applies", lambda x, backend: calls.append(backend) or True)
    x, weight, b, grad = _inputs(True, True)
    history = x.transpose(1, 2).contiguous()  # channel-major, as a CP region's cat makes it

    def ours(h, w, b):
        return conv_module.causal_conv(h, w, b, "triton")

    def conv1d(h, w, b):
        return F.conv1d(h, w, b, groups=h.shape[1])

    grad_c = grad.transpose(1, 2)
    got = _run(ours, history, weight, b, grad_c)
    truth = _run(conv1d, history.double(), weight.double(), b.double(), grad_c.double())
    assert calls == ["triton"] and _max_err(got, truth) < 1e-5


@cpu_only
def test_bfloat16_input_rounds_once():
    """bf16 in and out, the taps and SiLU in fp32: within bf16 rounding of the float64 oracle (one
    step, 2^-7: the interpreter truncates where a GPU rounds to nearest)."""
    x, weight, b, grad = _inputs(False, True)
    positions = positions_of("documents")
    ours = _run(lambda x, w, b: torch.ops.cpcompile.gdn_conv(x, w, b, positions, True, False),
                x.bfloat16(), weight.bfloat16(), b.bfloat16(), grad.bfloat16())
    truth = _run(lambda x, w, b: oracle(x, w, b, positions, False), x.bfloat16().double(),
                 weight.bfloat16().double(), b.bfloat16().double(), grad.bfloat16().double())
    assert ours[0].dtype == torch.bfloat16 and ours[2].dtype == torch.bfloat16
    assert _max_err(ours, truth) < 1e-2


@cpu_only
def test_negative_control_positions_ignored_is_far_from_the_kernel():
    """The check can fail: the oracle without positions (reading across document starts and into
    the halo before a document that starts at token 0) is far from the kernel with them."""
    x, weight, b, _ = _inputs(True, True)
    positions = positions_of("documents")
    ours = torch.ops.cpcompile.gdn_conv(x, weight, b, positions, True, True)
    assert (ours.double() - oracle(x, weight, b, positions, True)).abs().max() < 1e-5
    assert (ours.double() - oracle(x, weight, b, None, True)).abs().max() > 1e-1


def test_shapes_are_checked_on_metadata():
    """One-line errors before any kernel, on fake tensors too."""
    from cpcompile.errors import CPInputError

    x, weight = torch.randn(1, 2, 8), torch.randn(8, 1, 4)
    with pytest.raises(CPInputError, match="no output after"):
        torch.ops.cpcompile.gdn_conv(x, weight, None, None, True, True)
    with pytest.raises(CPInputError, match="positions must be integer"):
        torch.ops.cpcompile.gdn_conv(x, weight, None, torch.zeros(1, 2), True, False)


@cpu_only
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_layer_with_the_triton_conv_matches_the_layer_on_conv1d(monkeypatch, packed):
    """The Qwen3.5 layer's `gdn_core_inputs` with the kernel wired in (as on CUDA with the triton
    backend; forced here on the interpreter) gives the same q, k, v and parameter gradients as
    `F.conv1d` / `conv_taps` (fp32)."""
    from gdn_harness import TEXT, gdn_layer

    from cpcompile.adapters import qwen3_5

    layer = gdn_layer(1, torch.float32).layer
    hidden = torch.randn(2, 13, TEXT["hidden_size"])
    positions = torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 0, 1]]) if packed else None

    def run():
        q, k, v, *_ = qwen3_5.gdn_core_inputs(layer, hidden, None, positions, "triton")
        loss = sum((x.float() * torch.linspace(-1, 1, x.numel()).reshape(x.shape)).sum() for x in (q, k, v))
        return [q, k, v, *torch.autograd.grad(loss, [layer.conv1d.weight, layer.in_proj_qkv.weight])]

    reference = run()
    calls = []
    monkeypatch.setattr(qwen3_5, "triton_conv_applies", lambda x, backend: calls.append(backend) or True)
    wired = run()
    assert calls == ["triton"]
    for a, b in zip(wired, reference):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@cpu_only
def test_opcheck():
    """Schema, fake implementation and autograd registration agree with the real op (tiny shape)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 8 + KERNEL - 1, 4, generator=gen, requires_grad=True)  # the halo in front
    weight = torch.randn(4, 1, KERNEL, generator=gen, requires_grad=True)
    bias = torch.randn(4, generator=gen, requires_grad=True)
    positions = torch.tensor([[1, 2, 0, 1, 0, 1, 2, 3]])
    torch.library.opcheck(torch.ops.cpcompile.gdn_conv.default, (x, weight, bias, positions, True, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (no TRITON_INTERPRET)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_gpu_conv_matches_the_float64_oracle(dtype, bound):
    """On CUDA at the default tiles, C = 6144 (Qwen3.5's conv channels), 3000 tokens a row, B = 2,
    the halo in front, documents of 1 to 700 tokens and a bias: output and every gradient."""
    gen = torch.Generator().manual_seed(3)
    length, channels = 3000, 6144
    x = torch.randn(BATCH, length + KERNEL - 1, channels, generator=gen)
    weight, bias = torch.randn(channels, 1, KERNEL, generator=gen) / 2, torch.randn(channels, generator=gen)
    grad = torch.randn(BATCH, length, channels, generator=gen)
    sizes = torch.randint(1, 700, (2 * length,), generator=gen)
    positions = torch.stack([torch.cat([torch.arange(int(n)) for n in sizes[i::2]])[:length] for i in range(2)])
    positions[1, :5] += 7  # row 1 opens inside a document: its first outputs read the halo
    cast = [t.to("cuda", dtype) for t in (x, weight, bias, grad)]
    ours = _run(lambda x, w, b: torch.ops.cpcompile.gdn_conv(x, w, b, positions.cuda(), True, True), *cast)
    truth = _run(lambda x, w, b: oracle(x, w, b, positions.cuda(), True), *(t.double() for t in cast))
    assert _max_err(ours, truth) < bound
