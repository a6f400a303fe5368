"""The local batch the audits watch, when no attention core tells it (audit/tokens.py): from the
shapes of the example and of the first region's call, or refused when they leave it open."""
from __future__ import annotations

import pytest
import torch

from cpcompile.audit.tokens import TokenBatch, from_shapes
from cpcompile.errors import CPInputError


def test_the_one_size_shared_by_the_example_and_the_region_is_the_local_length():
    hidden = torch.zeros(2, 6, 16)
    q = torch.zeros(2, 4, 6, 4)  # [B, heads, S, D]: heads and D are no axis of the example
    assert from_shapes((hidden,), ((q, q, q), {})) == TokenBatch(2, 6)


def test_sizes_that_leave_the_length_open_are_refused():
    q = torch.zeros(1, 2, 4, 8)  # an example that is the region's own (q, k, v): 2, 4 and 8 all match
    with pytest.raises(CPInputError, match=r"sizes \[2, 4, 8\] are each an axis"):
        from_shapes((q, q, q), ((q, q, q), {}))


def test_sequence_axes_of_an_example_input():
    tokens = TokenBatch(2, 8)
    assert tokens.sequence_axes(torch.zeros(2, 8)) == (1,)
    assert tokens.sequence_axes(torch.zeros(2, 1, 8, 8)) == (2, 3)
    assert tokens.sequence_axes(torch.zeros(2, 5)) == ()


@pytest.mark.parametrize("shape", [(2, 8, 5, 3), (16, 7), (2, 8)])  # [B, S, ...], [B·S, ...], [B, S]
def test_per_token_maxima_in_slices_equal_the_whole(monkeypatch, shape):
    """The audit reads wide outputs (a large vocabulary's logits) a few tokens at a time; the maxima,
    of a tensor and of a difference, are those of the whole tensor."""
    import cpcompile.audit.tokens as tokens_module

    tokens, old, new = TokenBatch(2, 8), torch.randn(shape), torch.randn(shape).bfloat16()
    whole = (new.float() - old).abs().reshape(2, 8, -1).amax(-1)
    monkeypatch.setattr(tokens_module, "SLICE_ELEMENTS", 11)  # slices of one to three tokens
    torch.testing.assert_close(tokens.per_token(new, minus=old), whole, rtol=0, atol=0)
    torch.testing.assert_close(tokens.per_token(old), old.abs().reshape(2, 8, -1).amax(-1), rtol=0, atol=0)
