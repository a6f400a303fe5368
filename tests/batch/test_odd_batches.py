"""shard_batch on odd input: a clear `CPInputError` on every rank instead of a crash deep in a
forward, and every plan form `compile` takes (issue 12, item 8)."""
from __future__ import annotations

import types

import pytest
import torch

from cp_harness import sdpa_plan
from cpcompile.batch import shard_batch
from cpcompile.errors import CPInputError
from cpcompile.plan import load_plan


def _mesh(cp_size: int, cp_rank: int):
    return types.SimpleNamespace(cp_size=cp_size, cp_rank=cp_rank)


def _every_rank(batch, cp: int = 2, plan=None) -> list[str]:
    """The error each rank's shard_batch raises (all must raise)."""
    messages = []
    for rank in range(cp):
        with pytest.raises(CPInputError) as info:
            shard_batch(batch, _mesh(cp, rank), plan or load_plan(sdpa_plan(cp)))
        messages.append(str(info.value))
    return messages


@pytest.mark.parametrize("shape", [(0, 8), (2, 0)])
def test_an_empty_batch_is_refused(shape):
    ids = torch.zeros(shape, dtype=torch.long)
    for message in _every_rank({"input_ids": ids, "labels": ids}):
        assert "empty" in message and str(tuple(shape)) in message, message


@pytest.mark.parametrize("key", ["input_ids", "labels"])
def test_float_token_ids_are_refused(key):
    ids = torch.randint(0, 10, (2, 8))
    batch = {"input_ids": ids, "labels": ids.clone()}
    batch[key] = batch[key].float()
    for message in _every_rank(batch):
        assert repr(key) in message and "integer" in message and "torch.float32" in message, message


def test_float_ids_hint_at_inputs_embeds():
    (message, _) = _every_rank({"input_ids": torch.rand(2, 8)})
    assert "inputs_embeds" in message, message


def test_every_plan_form_compile_takes_is_accepted(tmp_path):
    """A dict (as `compile` takes), a YAML path and a Plan give the same local batch."""
    ids = torch.randint(0, 10, (2, 8))
    batch = {"input_ids": ids, "labels": ids.clone()}
    as_dict = sdpa_plan(2)
    path = tmp_path / "plan.yaml"
    path.write_text(
        "accelerator: {cp_size: 2}\nplan_overrides:\n"
        "  - {match: '*.self_attn', when: cp, region_dispatch: false, inner_wrapper: sdpa_hf}\n"
    )
    want = shard_batch(batch, _mesh(2, 1), load_plan(as_dict))
    for plan in (as_dict, path, str(path)):
        got = shard_batch(batch, _mesh(2, 1), plan)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))
