"""The probe forward records where attention runs without running it.

A CP rewrite probes the model once on the rank's local batch at the run's full length, before mixed
precision applies. Running SDPA there would cost the whole local attention in the parameters' dtype
(fp32 with grouped KV heads goes to SDPA's math kernel: [heads, S, S] scores, 512 GiB at 128K local
tokens, an out-of-memory at build on a 139 GiB GPU). The probe must record each call's site and
answer with zeros of the output's shape, as it does for GDN layers.
"""
from __future__ import annotations

import torch

from cp_harness import VOCAB, LargestTensor
from cpcompile.capture import probe_forward
from model_zoo import build

ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


class _AtenOps(LargestTensor):
    """The largest tensor (`LargestTensor`) and the name of every ATen op run while active."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_probe_records_sdpa_sites_without_running_attention():
    model = build("llama", seed=0)
    seq = 96
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    regions = {f"model.layers.{i}.self_attn": model.model.layers[i].self_attn for i in range(2)}
    with _AtenOps() as ops:
        result = probe_forward(model, {"input_ids": ids}, regions)
    sdpa_sites = [stack for kind, stack in result.core_sites if kind == "sdpa"]
    assert [stack[-1] for stack in sdpa_sites] == list(regions), result.core_sites
    assert set(result.inputs) == set(regions)
    ran = [name for name in ops.names if any(op in name for op in ATTENTION_OPS)]
    assert not ran, f"the probe ran attention kernels: {ran}"
    heads = model.config.num_attention_heads
    assert ops.numel < heads * seq * seq, "the probe made a [heads, S, S] tensor"
