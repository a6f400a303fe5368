"""`passes/gdn/conv_taps.py`: the packed-documents conv, traced tap by tap from the Qwen3.5 layer,
becomes one `causal_conv(history, weight, None, backend, positions)` call (so that a CP region runs
the Triton conv eagerly on CUDA), and the layer's result stays bit for bit the same on CPU; an
unpacked layer's `conv1d` is not mistaken for taps. (The CP packed tests, tests/gdn/test_gdn_packed.py,
run the rewritten regions against each document alone.)"""
from __future__ import annotations

import torch

from gdn_harness import TEXT, gdn_layer
from cpcompile.adapters.qwen3_5 import gdn_layer_forward
from cpcompile.kernels.gdn.conv import causal_conv
from cpcompile.passes.gdn.conv_taps import find_conv_taps, taps_for_compile

aten = torch.ops.aten


class _Layer(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, positions=None):
        return gdn_layer_forward(self.layer, hidden, None, positions, chunk_size=64, backend="eager")


def _exported(positions):
    module = _Layer(gdn_layer(1, torch.float32).layer)
    hidden = torch.randn(1, 13, TEXT["hidden_size"])
    args = (hidden,) if positions is None else (hidden, positions)
    gm = torch.export.export(module, args, strict=False).module()
    pad = next(n for n in gm.graph.nodes if n.target in (aten.pad.default, aten.constant_pad_nd.default))
    return gm, pad, args


def test_traced_taps_become_one_causal_conv_with_the_same_result():
    positions = torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 0, 1]])
    gm, pad, args = _exported(positions)
    before = gm(*args)
    assert taps_for_compile(gm, pad, "triton")
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.target is causal_conv]
    assert len(calls) == 1 and calls[0].args[3] == "triton" and list(pad.users) == calls
    assert not [n for n in gm.graph.nodes if n.target in (aten.slice.Tensor, aten.where.ScalarOther)
                and pad in n.all_input_nodes]
    assert torch.equal(gm(*args), before)


def test_an_unpacked_conv1d_is_not_taps():
    gm, pad, _ = _exported(None)
    assert find_conv_taps(pad) is None
