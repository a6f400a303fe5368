"""TRL's padding-free batches carry flash attention's varlen keys beside position ids
(`cu_seq_lens_q/k`, `max_length_q/k`, `seq_idx`); the Trainer integration takes them out once they
agree with the position ids (or turns `cu_seq_lens_q` into shard_batch's `cu_seq_lens` when there are
none), and refuses a batch whose keys disagree, naming the key."""
from __future__ import annotations

import pytest
import torch

from cpcompile.errors import CPInputError
from cpcompile.integrations.hf_data import without_varlen_keys


def _trl_batch(lengths=(5, 3, 4)) -> dict:
    """What TRL 1.16's DataCollatorForLanguageModeling(padding_free=True) returns for one packed row."""
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(1, 50, positions.shape)
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].int()
    return {"input_ids": ids, "labels": ids.masked_fill(positions == 0, -100), "position_ids": positions,
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(), "max_length_q": max(lengths),
            "max_length_k": max(lengths), "seq_idx": documents}


def test_varlen_keys_go_once_they_agree_with_the_position_ids():
    batch = _trl_batch()
    out = without_varlen_keys(batch)
    assert sorted(out) == ["input_ids", "labels", "position_ids"]
    assert out["position_ids"] is batch["position_ids"]
    assert without_varlen_keys(out) is out  # a batch without them is untouched


def test_without_position_ids_the_documents_come_from_cu_seq_lens_q():
    batch = _trl_batch()
    del batch["position_ids"]
    out = without_varlen_keys(batch)
    assert torch.equal(out["cu_seq_lens"], batch["cu_seq_lens_q"]) and "cu_seq_lens_q" not in out


@pytest.mark.parametrize("key, change", [
    ("position_ids", lambda b: b["position_ids"].roll(1, -1)),
    ("seq_idx", lambda b: b["seq_idx"] * 0),
    ("max_length_q", lambda b: 3),
    ("cu_seq_lens_k", lambda b: torch.tensor([0, 4, 8, 12], dtype=torch.int32)),
])
def test_disagreeing_varlen_keys_are_refused_naming_the_key(key, change):
    batch = _trl_batch()
    batch[key] = change(batch)
    with pytest.raises(CPInputError, match=key) as caught:
        without_varlen_keys(batch)
    assert "\n" not in str(caught.value)
