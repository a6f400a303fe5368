"""The trainer with `data.packing: true` (cpcompile/trainer/data.py): rows of documents laid end to
end, position ids restarting at 0 per document, labels ending at document ends.

Unit tests of the packed stream (file and synthetic), then real gloo runs, float64: a packed run at
cp 2 (GDN State-P2P eager + SDPA AllGather on synthetic documents; GDN State-P2P + SDPA Ulysses on
a JSONL file) follows the same packed run in one process without a plan, and `train.verify`
passes; a packed run stopped and resumed from its checkpoint continues the same trajectory; packing
without the eager GDN core outside CP is refused."""
from __future__ import annotations

import json
import random

import pytest
import torch

from dist_utils import run_distributed
from gdn_harness import TWO_LAYERS, gdn_plan
from test_trainer import STEP_1_RTOL, _close, _curves, _run, qwen3_5_config, without_cp

BYTE_VOCAB = 257  # the byte tokenizer's ids


def _stream(tmp_path, docs: list[str] | None, seq_len: int, batch_size: int = 2, seed: int = 0, packing=True):
    from cpcompile.trainer.config import DataSettings, TrainSettings
    from cpcompile.trainer.data import TokenStream

    if docs is None:
        data = DataSettings(packing=packing)
    else:
        path = tmp_path / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
        data = DataSettings(source="jsonl", path=str(path), packing=packing)
    settings = TrainSettings(seq_len=seq_len, batch_size=batch_size, seed=seed)
    return TokenStream(data, settings, BYTE_VOCAB)


def _random_docs(count: int) -> list[str]:
    return ["".join(random.choice("abcdefgh") for _ in range(random.randint(1, 20))) for _ in range(count)]


def test_packing_is_off_by_default_and_rows_hold_one_padded_document(tmp_path):
    from cpcompile.trainer.config import DataSettings

    assert DataSettings().packing is False
    docs = _random_docs(3)
    batch = _stream(tmp_path, docs, seq_len=24, batch_size=3, packing=False).batch(0)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    for row, doc in enumerate(docs):
        tokens = list(doc.encode()) + [256]
        assert batch["attention_mask"][row].sum() == len(tokens)
        assert batch["input_ids"][row, : len(tokens)].tolist() == tokens
        assert (batch["labels"][row, len(tokens):] == -100).all()


@pytest.mark.parametrize("line, words", [('{"text": 7}', "'text' is of type int, not a string"),
                                         ('{"body": "x"}', "not a JSON object with a string 'text'"),
                                         ("[1, 2]", "not a JSON object"), ('{"text": ""}', "holds no document")])
def test_a_jsonl_record_without_a_string_text_is_refused_by_line(tmp_path, line, words):
    """Nothing dropped silently: a record whose text field is missing or not a string names its line."""
    from cpcompile.errors import PlanError
    from cpcompile.trainer.config import DataSettings
    from cpcompile.trainer.data import read_documents

    path = tmp_path / "docs.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(PlanError, match=words):
        read_documents(DataSettings(source="jsonl", path=str(path)))


def test_a_packed_file_row_lays_documents_end_to_end_and_restarts_positions(tmp_path):
    """Documents in file order, cycled; one that overflows a row goes on in the next, from
    position 0; labels are -100 at every document's first token, so after `shard_batch`'s shift
    the last token of every document predicts nothing."""
    from cpcompile import shard_batch

    docs = ["x" * 20] + _random_docs(6)  # the first one overflows row 0
    encoded = [list(doc.encode()) + [256] for doc in docs]
    seq_len, batch_size = 16, 2
    stream = _stream(tmp_path, docs, seq_len, batch_size)
    flat = [t for doc in encoded for t in doc]
    flat_positions = [p for doc in encoded for p in range(len(doc))]
    split = 0
    for step in range(4):
        batch = stream.batch(step)
        assert set(batch) == {"input_ids", "position_ids", "labels"}
        for row in range(batch_size):
            start = (step * batch_size + row) * seq_len
            where = [(start + k) % len(flat) for k in range(seq_len)]
            assert batch["input_ids"][row].tolist() == [flat[w] for w in where]
            expected = [0] * seq_len  # a document split at the row start counts from 0 there
            for k in range(1, seq_len):
                expected[k] = 0 if flat_positions[where[k]] == 0 else expected[k - 1] + 1
            assert batch["position_ids"][row].tolist() == expected
            split += flat_positions[where[0]] != 0
        starts = batch["position_ids"] == 0
        assert (batch["labels"][starts] == -100).all()
        assert (batch["labels"][~starts] == batch["input_ids"][~starts]).all()
        targets = shard_batch(batch, None, None)["shift_labels"]
        ends = torch.zeros_like(starts)
        ends[:, :-1] = starts[:, 1:]
        ends[:, -1] = True
        assert (targets[ends] == -100).all() and (targets[~ends] != -100).all()
    assert split


def test_packed_rows_depend_on_the_row_index_only(tmp_path):
    """Row i is a function of (seed, i): the step is the data position, whatever the replica split."""
    for docs in (None, _random_docs(5)):
        stream = _stream(tmp_path, docs, seq_len=16, batch_size=4, seed=3)
        whole = stream.batch(2)
        halves = [stream.batch(2, replica, 2) for replica in (0, 1)]
        for key in whole:
            assert torch.equal(whole[key], torch.cat([h[key] for h in halves]))
            assert torch.equal(whole[key], _stream(tmp_path, docs, seq_len=16, batch_size=4, seed=3).batch(2)[key])


def test_synthetic_packing_draws_random_document_lengths(tmp_path):
    """Several documents a row, of varying lengths (some of one token), other ones per seed."""
    stream = _stream(tmp_path, None, seq_len=64, batch_size=8)
    positions = stream.batch(0)["position_ids"]
    starts = (positions == 0).sum(dim=1)
    assert (starts >= 2).all() and len(set(starts.tolist())) > 1
    assert not torch.equal(positions, _stream(tmp_path, None, seq_len=64, batch_size=8, seed=1).batch(0)["position_ids"])
    unpacked = _stream(tmp_path, None, seq_len=64, batch_size=8, packing=False).batch(0)
    assert torch.equal(stream.batch(0)["input_ids"], unpacked["input_ids"])


# --------------------------------------------------------------------------- gloo runs


def _packed(seed: int, cp: int, sdpa: str = "sdpa_hf", path: str | None = None, **gdn) -> dict:
    config = qwen3_5_config(seed, cp=cp, batch_size=2, model=TWO_LAYERS)  # a region of each kind (CI time)
    config.update(gdn_plan(cp, "p2p", sdpa=sdpa, **gdn))
    config["data"] = {"packing": True}
    if path is not None:
        config["model"]["vocab_size"] = BYTE_VOCAB
        config["data"].update(source="jsonl", path=path)
    return config


def _two_ranks(rank: int, world: int, seed: int, path: str, folder: str) -> dict:
    out = {"synthetic": _curves(_run(_packed(seed, 2))),
           "jsonl_ulysses": _curves(_run(_packed(seed, 2, sdpa="sdpa_hf_ulysses", path=path)))}
    verified = _packed(seed, 2)
    verified["train"].update(verify=True, verify_rtol=1e-6)  # each step against an unrewritten copy
    out["verified"] = _curves(_run(verified))
    saving = dict(_packed(seed, 2), checkpoint={"folder": folder, "interval": 2})
    out["stopped"] = _curves(_run(saving, stop_after=2))
    out["resumed"] = _curves(_run(saving))
    return out


def _one_rank(rank: int, world: int, seed: int, path: str) -> dict:
    from cpcompile.errors import PlanError

    out = {"synthetic": _curves(_run(without_cp(_packed(seed, 2)))),
           "jsonl": _curves(_run(without_cp(_packed(seed, 2, path=path))))}
    transformers_gdn = without_cp(_packed(seed, 2))
    transformers_gdn["train"]["gdn_backend"] = None
    try:
        _run(transformers_gdn)
    except PlanError as exc:
        out["transformers_gdn"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    seed = random.randrange(1 << 30)
    folder = tmp_path_factory.mktemp("packed")
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in _random_docs(9)))
    two = run_distributed(_two_ranks, 2, seed, str(path), str(folder / "ckpt"), timeout=600)
    one = run_distributed(_one_rank, 1, seed, str(path), timeout=300)[0]
    return two, one


def test_a_packed_cp_2_run_follows_the_packed_run_without_a_plan(runs):
    """GDN State-P2P (eager) with SDPA AllGather on synthetic documents, and with SDPA Ulysses on a
    JSONL file, float64: step 1's loss and gradient norm within `STEP_1_RTOL` (one exact forward and
    backward), every later step's within 1e-6 (float64 rounding grows over the AdamW steps, as in
    test_trainer at its `LR`); the same on both ranks."""
    two, one = runs
    for cp2, alone in ((two[0]["synthetic"], one["synthetic"]), (two[0]["jsonl_ulysses"], one["jsonl"])):
        assert _close(cp2[:1], alone[:1], STEP_1_RTOL) and _close(cp2, alone, 1e-6), (cp2, alone)
    assert two[1]["synthetic"] == two[0]["synthetic"]
    assert two[0]["verified"] == two[0]["synthetic"]  # verify (train.verify) passed every step


def test_a_resumed_packed_run_continues_the_same_trajectory(runs):
    two, _ = runs
    full = two[0]["synthetic"]
    assert two[0]["stopped"] == full[:2]
    assert two[0]["resumed"] == full[2:]


def test_packing_with_transformers_gdn_outside_cp_is_refused(runs):
    _, one = runs
    message = one.get("transformers_gdn", "")
    assert message.startswith("train.gdn_backend") and "eager" in message, message
