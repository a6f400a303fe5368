"""`benchmarks/masked_attention.py` imports and answers `--help` on a CPU (no CUDA at import), and its
cu_seq_q/cu_seq_k derivation from key tags, run per segment as varlen attention does (causal aligned
bottom-right), gives the float64 oracle's output on every real query row (CPU, tiny, no kernel)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from cpcompile.kernels.attention.naive import naive_attention

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import masked_attention  # noqa: E402
import masked_attention_kernels as kernels  # noqa: E402


def test_help_on_cpu(capsys):
    with pytest.raises(SystemExit) as exit_:
        masked_attention.main(["--help"])
    assert exit_.value.code == 0
    assert "--quick" in capsys.readouterr().out


def _per_segment(q, k, v, cu_q, cu_k):
    """Varlen attention's semantics, spelled out: segment i's queries against its keys, causal from the
    bottom right; K/V heads repeated for GQA."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = torch.zeros_like(q)
    for qa, qb, ka, kb in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        scores = q[:, :, qa:qb] @ k[:, :, ka:kb].transpose(-1, -2) * q.shape[-1] ** -0.5
        seen = torch.arange(kb - ka)[None, :] <= torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa)
        out[:, :, qa:qb] = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v[:, :, ka:kb]
    return out


@pytest.mark.parametrize("start", [0, 96])
@pytest.mark.parametrize("kind", ["unpadded", "pad 10%", "documents and padding"])
def test_segments_match_the_oracle(kind, start):
    keys = 256
    if kind == "documents and padding":
        starts = torch.rand(keys, generator=torch.Generator().manual_seed(0)) < 1 / 30
        starts[0] = False
        tags = starts.long().cumsum(0)[None]
        tags[0, -20:] = -(tags[0, -21] + 1)
    else:
        tags = masked_attention.batch_tags(kind, keys, "cpu")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, s, 8, generator=gen, dtype=torch.float64)
               for h, s in ((4, keys - start), (2, keys), (2, keys)))
    cu_q, cu_k, max_q, max_k = kernels.segments(tags, start, keys - start)
    got = _per_segment(q, k, v, cu_q, cu_k)
    want = naive_attention(q, k, v, [start], key_tags=tags)
    real = tags[0, start:] >= 0
    torch.testing.assert_close(got[:, :, real], want[:, :, real])
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())


def _varlen_on_cpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                   enable_gqa=False, return_aux=None, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's `varlen_attn` signature over `_per_segment`: `[T, H, D]` in and out."""
    assert window_size == (-1, 0) and enable_gqa == (query.shape[1] != key.shape[1])
    assert max_q >= int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) and max_k >= int((cu_seq_k[1:] - cu_seq_k[:-1]).max())
    heads_first = [x.transpose(0, 1)[None] for x in (query, key, value)]
    return _per_segment(*heads_first, cu_seq_q, cu_seq_k)[0].transpose(0, 1)


@pytest.mark.parametrize("exact_max", [True, False])
def test_varlen_row_layout(monkeypatch, exact_max):
    """The varlen row's reshapes (`[B, H, S, D]` views to `[T, H, D]` and back), its chunk offsets and GQA
    flag, with the kernel replaced by `_varlen_on_cpu`: the oracle's output on every real query row."""
    monkeypatch.setattr(kernels, "_varlen_api", lambda: _varlen_on_cpu)
    keys, start = 256, 128
    tags = (torch.rand(keys, generator=torch.Generator().manual_seed(2)) < 1 / 40).long().cumsum(0)[None]
    tags[0, -16:] = -(tags[0, -17] + 1)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, s, h, 8, generator=gen, dtype=torch.float64).transpose(1, 2)
               for h, s in ((4, keys - start), (2, keys), (2, keys)))
    got = kernels.varlen(exact_max)(q, k, v, tags, [start])
    want = naive_attention(q, k, v, [start], key_tags=tags)
    real = tags[0, start:] >= 0
    torch.testing.assert_close(got[:, :, real], want[:, :, real])
