"""The chunked loss's Triton kernels (`cpcompile/kernels/loss/triton_chunk.py`) against their float64
oracle (`naive.py`), in Triton's interpreter on CPU: rows whose largest logit sits in a later block of
the vocabulary (the online maximum must rescale), a ragged last block, the soft-cap, bfloat16 and
float32 logits; the gradient overwrites the logits it reads."""
from __future__ import annotations

import pytest
import torch

from cpcompile.kernels.loss import naive

triton_chunk = pytest.importorskip("cpcompile.kernels.loss.triton_chunk")
ROWS, VOCAB = 6, 333  # three blocks of 128, the last ragged


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(triton_chunk, "BLOCK", 128)


def _logits(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=gen, dtype=torch.float64) * 4
    logits[0, 300] = 60.0  # the row's maximum in the last block: exp(60 - 0) alone overflows nothing,
    logits[1, 5] = 60.0    # but without the rescale the first blocks' sums would be kept at the wrong scale
    logits[2] = 0.0        # a flat row
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    targets[0], targets[3] = 300, VOCAB - 1
    return logits.to(dtype), targets


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_loss_terms_and_gradient_match_the_oracle(dtype, softcap):
    logits, targets = _logits(7, dtype)
    lse, target_logit = triton_chunk.loss_terms(logits, targets, softcap)
    want_lse, want_target = naive.naive_loss_terms(logits, targets, softcap)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(target_logit.double(), want_target, rtol=1e-6, atol=1e-5)
    scale = torch.tensor(0.37)
    buffer = logits.clone()
    grad = triton_chunk.logit_gradient_(buffer, targets, lse, scale, softcap)
    assert grad.data_ptr() == buffer.data_ptr() and grad.dtype == dtype
    want = naive.naive_logit_gradient(logits, targets, 0.37, softcap)
    torch.testing.assert_close(grad.double(), want, rtol=_tolerance(dtype), atol=_tolerance(dtype) * 0.37)


def test_a_wrong_column_is_caught():
    """Negative control: the oracle comparison above notices one logit moved."""
    logits, targets = _logits(8, torch.float32)
    lse, _ = triton_chunk.loss_terms(logits, targets, None)
    moved = logits.clone()
    moved[4, 200] = moved[4].max() + 1  # now the row's largest: its log-sum-exp moves by more than 0.3
    with pytest.raises(AssertionError):
        torch.testing.assert_close(lse.double(), naive.naive_loss_terms(moved, targets, None)[0], rtol=1e-6, atol=1e-5)


def test_bad_layout_is_refused():
    logits, targets = _logits(9, torch.float32)
    with pytest.raises(ValueError, match="unit column stride"):
        triton_chunk.loss_terms(logits.t(), targets, None)
