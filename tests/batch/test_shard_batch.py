"""shard_batch / unshard / layout helpers: the CP batch contract."""
from __future__ import annotations

import types

import pytest
import torch

from cpcompile.errors import CPInputError
import torch.distributed as dist

from cpcompile.batch import shard_batch, unshard
from cpcompile.batch_fields import ALLOWED_KEYS
from cpcompile.methods import CONTIGUOUS, HEAD_TAIL, CPMethod
from cpcompile.plan import AcceleratorConfig, Override, Plan
from cpcompile.sequence_layout import local_indices, reorder_for_layout, restore_order

from dist_utils import run_distributed as _launch

LAYOUTS = [CONTIGUOUS, HEAD_TAIL]


# ----------------------------------------------------------------------------- stand-ins


def _override(match, method=None, local_compute_fn=None):
    return Override(match=match, when="cp", region_dispatch=False, method=method, local_compute_fn=local_compute_fn)


def _plan(layout, cp_size, *wrappers, extra=()):
    """A plan of one `when: cp` override per wrapper, each a method needing `layout` (+ `extra`)."""
    wrappers = wrappers or ("w_" + layout,)
    overrides = [_override(f"layers.*.attn{i}", CPMethod("m", "sdpa", w, layout=layout)) for i, w in enumerate(wrappers)]
    return Plan(AcceleratorConfig(cp_size=cp_size), (*overrides, *extra))


def _mesh(cp_size, cp_rank):
    return types.SimpleNamespace(cp_size=cp_size, cp_rank=cp_rank)


def _batch(bsz, seq_len, *, vocab=11, mask_pad=0, labels=True):
    """Random global batch; the last `mask_pad` tokens of row 0 are right padding."""
    ids = torch.randint(1, vocab, (bsz, seq_len))
    out = {"input_ids": ids}
    if mask_pad:
        mask = torch.ones(bsz, seq_len, dtype=torch.long)
        mask[0, seq_len - mask_pad :] = 0
        out["attention_mask"] = mask
    if labels:
        lab = ids.clone()
        if mask_pad:
            lab[out["attention_mask"] == 0] = -100
        out["labels"] = lab
    return out


def _all_local(batch, cp, layout, **kw):
    plan = _plan(layout, cp)
    return [shard_batch(batch, _mesh(cp, r), plan, **kw) for r in range(cp)]


def _reassemble(locals_, key, cp, layout):
    """The global tensor back from every rank's local one (a packed Head-Tail batch: by its marked
    global positions, as it is cut per document)."""
    gathered = torch.cat([loc[key] for loc in locals_], dim=1)
    positions = [getattr(loc["position_ids"], "_cpcompile_global_positions", None) for loc in locals_]
    if positions[0] is None:
        return restore_order(gathered, cp, layout)
    return gathered.gather(1, torch.argsort(torch.cat(positions, dim=1), dim=1).expand_as(gathered))


# ----------------------------------------------------------------------------- pure layout helpers


def test_local_indices_known_values():
    assert local_indices(8, 2, 0, CONTIGUOUS).tolist() == [0, 1, 2, 3]
    assert local_indices(8, 2, 1, CONTIGUOUS).tolist() == [4, 5, 6, 7]
    assert local_indices(8, 2, 0, HEAD_TAIL).tolist() == [0, 1, 6, 7]
    assert local_indices(8, 2, 1, HEAD_TAIL).tolist() == [2, 3, 4, 5]
    assert local_indices(8, 4, 1, HEAD_TAIL).tolist() == [1, 6]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_layout_partitions_and_roundtrips(layout, cp):
    seq_len = 2 * cp * int(torch.randint(1, 5, (1,)))
    held = torch.cat([local_indices(seq_len, cp, r, layout) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq_len))
    x = torch.randn(3, seq_len, 5)
    rank_major = reorder_for_layout(x, cp, layout)
    torch.testing.assert_close(rank_major, x[:, held], rtol=0, atol=0)
    torch.testing.assert_close(restore_order(rank_major, cp, layout), x, rtol=0, atol=0)
    y = torch.randn(seq_len, 2)
    torch.testing.assert_close(restore_order(reorder_for_layout(y, cp, layout, seq_dim=0), cp, layout, seq_dim=0), y)


# ----------------------------------------------------------------------------- shard_batch


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [2, 4])
def test_shards_reassemble_to_global_fields(layout, cp):
    seq_len = 4 * cp
    batch = _batch(2, seq_len, mask_pad=3)
    batch["inputs_embeds"] = torch.randn(2, seq_len, 3)
    del batch["input_ids"]
    locals_ = _all_local(batch, cp, layout)
    for key in ("inputs_embeds", "attention_mask", "labels"):
        torch.testing.assert_close(_reassemble(locals_, key, cp, layout), batch[key], rtol=0, atol=0)
    positions = _reassemble(locals_, "position_ids", cp, layout)
    assert (positions == torch.arange(seq_len)).all()
    for r, loc in enumerate(locals_):
        idx = local_indices(seq_len, cp, r, layout)
        assert loc["position_ids"].tolist() == [idx.tolist()] * 2  # global numbers, never from 0
        assert loc["use_cache"] is False
        assert loc["num_items_in_batch"].item() == int((batch["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [2, 4])
def test_labels_shift_globally_across_rank_boundaries(layout, cp):
    seq_len = 4 * cp
    batch = _batch(2, seq_len)
    labels = batch["labels"]
    locals_ = _all_local(batch, cp, layout)
    for r, loc in enumerate(locals_):
        idx = local_indices(seq_len, cp, r, layout)
        for j, g in enumerate(idx.tolist()):
            want = labels[:, g + 1] if g + 1 < seq_len else torch.full((2,), -100)
            assert loc["shift_labels"][:, j].tolist() == want.tolist()
        if layout == CONTIGUOUS and r + 1 < cp:
            # the last target of rank r is the first token of rank r+1
            assert loc["shift_labels"][:, -1].tolist() == locals_[r + 1]["labels"][:, 0].tolist()


def test_shifted_labels_follow_hugging_face_at_padding():
    """The padding mask does not touch targets (HF CP=1 semantics); -100 labels stay ignored."""
    batch = _batch(2, 8, mask_pad=0)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    mask[1, :2] = 0
    batch["attention_mask"] = mask
    batch["labels"][0, 6] = -100
    shifted = shard_batch(batch, _mesh(1, 0), _plan(CONTIGUOUS, 1))["shift_labels"]
    assert shifted[:, :-1].tolist() == batch["labels"][:, 1:].tolist()
    assert (shifted[:, -1] == -100).all() and shifted[0, 5] == -100


def test_cp1_keeps_sequence_and_adds_contract_fields():
    batch = _batch(2, 7)
    out = shard_batch(batch, _mesh(1, 0), _plan(CONTIGUOUS, 1))
    assert out["input_ids"] is batch["input_ids"] and out["labels"] is batch["labels"]
    assert out["use_cache"] is False
    assert out["position_ids"].tolist() == [list(range(7))] * 2
    assert out["num_items_in_batch"].item() == 12
    assert shard_batch(batch, None, None)["use_cache"] is False


@pytest.mark.parametrize("layout, multiple", [(CONTIGUOUS, 4), (HEAD_TAIL, 8)])
def test_seq_len_not_multiple_is_refused(layout, multiple):
    batch = _batch(1, 10)
    with pytest.raises(ValueError) as err:
        shard_batch(batch, _mesh(4, 0), _plan(layout, 4))
    msg = str(err.value)
    assert "S=10" in msg and f"multiple of {multiple}" in msg and layout in msg and "pad=True" in msg


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pad_true_right_pads_every_field(layout, with_mask):
    cp, seq_len = 2, 9
    batch = _batch(2, seq_len, mask_pad=2 if with_mask else 0)
    batch["position_ids"] = torch.arange(seq_len).unsqueeze(0) + 5
    n_valid = int((batch["labels"][:, 1:] != -100).sum())
    locals_ = _all_local(batch, cp, layout, pad=True, pad_token_id=7)
    padded = 12 if layout == HEAD_TAIL else 10
    ids = _reassemble(locals_, "input_ids", cp, layout)
    assert ids.shape == (2, padded) and (ids[:, seq_len:] == 7).all()
    assert (ids[:, :seq_len] == batch["input_ids"]).all()
    assert (_reassemble(locals_, "labels", cp, layout)[:, seq_len:] == -100).all()
    assert (_reassemble(locals_, "shift_labels", cp, layout)[:, seq_len - 1 :] == -100).all()
    assert _reassemble(locals_, "position_ids", cp, layout).tolist() == [list(range(5, 5 + padded))]
    if with_mask:
        mask = _reassemble(locals_, "attention_mask", cp, layout)
        assert (mask[:, seq_len:] == 0).all() and (mask[:, :seq_len] == batch["attention_mask"]).all()
    elif layout == HEAD_TAIL:  # all ones: keeps transformers from building a two-document local mask
        assert all((loc["attention_mask"] == 1).all() for loc in locals_)
    else:
        assert "attention_mask" not in locals_[0]
    assert all(loc["num_items_in_batch"].item() == n_valid for loc in locals_)


def test_4d_mask_is_refused():
    batch = _batch(1, 8)
    batch["attention_mask"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="2-D"):
        shard_batch(batch, _mesh(2, 0), _plan(CONTIGUOUS, 2))


@pytest.mark.parametrize(
    "key, value",
    [
        ("past_key_values", object()),
        ("use_cache", True),
        ("cu_seq_lens_q", torch.tensor([0, 4, 8])),
        ("cu_seq_lens_k", torch.tensor([0, 4, 8])),
        ("max_length_q", 4),
        ("max_length_k", 4),
        ("seq_idx", torch.zeros(1, 8, dtype=torch.int32)),
        ("cache_position", torch.arange(8)),
        ("logits_to_keep", 1),
        ("token_type_ids", torch.zeros(1, 8, dtype=torch.long)),
        ("my_flag", "x"),
    ],
)
def test_rejected_keys_are_named(key, value):
    batch = _batch(1, 8)
    batch[key] = value
    with pytest.raises(ValueError) as err:
        shard_batch(batch, _mesh(2, 0), _plan(CONTIGUOUS, 2))
    assert repr(key) in str(err.value) or f"{key}=" in str(err.value)
    if key in ("token_type_ids", "my_flag"):
        assert "Allowed keys" in str(err.value) and "position_ids" in str(err.value)


PACKED = [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1]]  # documents of 3, 5, 2 and 2 tokens


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_documents_end_their_targets_and_keep_their_positions(layout):
    batch = _batch(1, 12)
    batch["position_ids"] = torch.tensor(PACKED)
    locals_ = _all_local(batch, 2, layout)
    assert _reassemble(locals_, "position_ids", 2, layout).tolist() == PACKED
    targets = _reassemble(locals_, "shift_labels", 2, layout)[0]
    ends = [2, 7, 9, 11]  # a document's last token predicts nothing
    assert all(targets[i] == -100 for i in ends)
    assert targets[[0, 1, 3, 8, 10]].tolist() == batch["labels"][0, [1, 2, 4, 9, 11]].tolist()
    assert all(loc["num_items_in_batch"].item() == 12 - len(ends) for loc in locals_)
    # an all-ones mask keeps transformers from building its own local document mask
    assert all((loc["attention_mask"] == 1).all() for loc in locals_)


def test_cu_seq_lens_is_the_same_packed_batch():
    batch = _batch(1, 12)
    via_positions = shard_batch({**batch, "position_ids": torch.tensor(PACKED)}, _mesh(2, 1), _plan(CONTIGUOUS, 2))
    via_lengths = shard_batch({**batch, "cu_seq_lens": torch.tensor([0, 3, 8, 10, 12])}, _mesh(2, 1),
                              _plan(CONTIGUOUS, 2))
    assert set(via_lengths) == set(via_positions) and "cu_seq_lens" not in via_lengths
    for key, value in via_positions.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(via_lengths[key])), key


@pytest.mark.parametrize("bad, words", [
    ({"position_ids": torch.tensor([[0, 1, 2, 5, 6, 7, 8, 9, 0, 1, 0, 1]])}, "restart at 0"),
    ({"position_ids": torch.tensor([[1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 0, 1]])}, "first token"),
    ({"position_ids": torch.tensor(PACKED), "attention_mask": torch.tensor([[1] * 11 + [0]])}, "padding"),
    ({"cu_seq_lens": torch.tensor([0, 3, 3, 12])}, "rise strictly"),
    ({"cu_seq_lens": torch.tensor([0, 3, 8]), "position_ids": torch.tensor(PACKED)}, "not both"),
    ({"cu_seq_lens_q": torch.tensor([0, 3, 12])}, "cu_seq_lens"),
])
def test_malformed_packing_is_refused(bad, words):
    with pytest.raises(CPInputError, match=words):
        shard_batch({**_batch(1, 12), **bad}, _mesh(2, 0), _plan(CONTIGUOUS, 2))


def _gdn_override(backend: str):
    return _override("layers.*.linear_attn", CPMethod("p2p", "gdn", "qwen3_5_gdn_p2p_cp_wrapper",
                                                      params={"backend": backend, "chunk_size": 64}))


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_gdn_plans_take_packed_documents_and_mark_them(backend):
    plan = _plan(CONTIGUOUS, 2, extra=[_gdn_override(backend)])
    packed = shard_batch({**_batch(1, 12), "position_ids": torch.tensor(PACKED)}, _mesh(2, 1), plan)
    plain = shard_batch(_batch(1, 12), _mesh(2, 1), plan)
    assert packed["position_ids"]._cpcompile_packed and not plain["position_ids"]._cpcompile_packed


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_is_told_whether_the_global_batch_masks_any_key(layout):
    """One fact of the global batch, alike on every rank (issue 48): unmasked only when no key is padded
    anywhere and each row is one document counting from 0; a rank with no padding of its own is told
    the other's. The attention regions pick their kernel by it without reading the keys back."""
    def told(batch, **kw):
        return {shard_batch(batch, _mesh(2, r), _plan(layout, 2), **kw)["position_ids"]._cpcompile_unmasked
                for r in range(2)}

    assert told(_batch(2, 12)) == told(_batch(2, 12, mask_pad=0) | {"attention_mask": torch.ones(2, 12)}) == {True}
    assert told(_batch(2, 12, mask_pad=2)) == {False}  # row 0's last tokens: on the last rank only
    assert told({**_batch(1, 12), "position_ids": torch.tensor(PACKED)}) == {False}
    assert told(_batch(2, 11) | {"attention_mask": torch.ones(2, 11)}, pad=True) == {False}  # padded by shard_batch
    assert told({**_batch(1, 12), "position_ids": torch.arange(3, 15)[None]}) == {False}  # a document not from 0


def test_harmless_flags_pass_through():
    batch = _batch(1, 8)
    batch.update(use_cache=False, past_key_values=None, return_dict=True, output_hidden_states=False)
    out = shard_batch(batch, _mesh(2, 1), _plan(CONTIGUOUS, 2))
    assert out["return_dict"] is True and out["output_hidden_states"] is False
    assert "past_key_values" not in out and out["use_cache"] is False
    assert set(out) <= ALLOWED_KEYS


def test_mixed_layouts_name_both_wrappers():
    head_tail = _override("attn", CPMethod("ht", "sdpa", "sdpa_head_tail", layout=HEAD_TAIL))
    mixed = _plan(CONTIGUOUS, 2, "gdn_p2p_wrapper", extra=[head_tail])
    with pytest.raises(ValueError) as err:
        shard_batch(_batch(1, 8), _mesh(2, 0), mixed)
    assert "gdn_p2p_wrapper" in str(err.value) and "sdpa_head_tail" in str(err.value)


def test_cp_without_active_override_is_refused():
    plan = Plan(AcceleratorConfig(cp_size=2))
    with pytest.raises(ValueError, match="no active CP override"):
        shard_batch(_batch(1, 8), _mesh(2, 0), plan)


# ----------------------------------------------------------------------------- loss equivalence with HF


@pytest.mark.parametrize("case", ["plain", "right_padding", "pad_true"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [2, 4])
def test_sum_of_rank_hf_losses_equals_cp1_hf_loss(cp, layout, case):
    from transformers.loss.loss_utils import ForCausalLMLoss

    vocab = 13
    seq_len = 2 * cp * 3 + (1 if case == "pad_true" else 0)
    batch = _batch(3, seq_len, vocab=vocab, mask_pad=4 if case == "right_padding" else 0)
    padded_len = seq_len + (-seq_len) % (2 * cp if layout == HEAD_TAIL else cp)
    logits = torch.randn(3, padded_len, vocab)  # fixed logits: attention is not under test here

    ref = ForCausalLMLoss(logits[:, :seq_len].contiguous(), batch["labels"], vocab)  # HF's own CP=1 path
    total = 0.0
    for r, loc in enumerate(_all_local(batch, cp, layout, pad=case == "pad_true")):
        local_logits = logits[:, local_indices(padded_len, cp, r, layout)]
        total = total + ForCausalLMLoss(
            local_logits,
            loc["labels"],
            vocab,
            num_items_in_batch=loc["num_items_in_batch"],
            shift_labels=loc["shift_labels"],
        )
    torch.testing.assert_close(total, ref, rtol=1e-6, atol=1e-6)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def test_hf_model_consumes_contract_fields():
    """model(**local) really reads shift_labels and num_items_in_batch (HF kwargs flow to the loss)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = _tiny_llama()
    batch = _batch(2, 8, vocab=32, mask_pad=3)
    with torch.no_grad():
        # cp=1: the contract reproduces HF's own loss on the plain batch
        plain = model(**batch).loss
        contract = model(**shard_batch(batch, _mesh(1, 0), _plan(CONTIGUOUS, 1))).loss
        torch.testing.assert_close(contract, plain, rtol=1e-6, atol=1e-6)

        # cp=2, rank 0: the loss is this rank's share of the global mean, from the global targets
        local = shard_batch(batch, _mesh(2, 0), _plan(CONTIGUOUS, 2))
        out = model(**local)
        share = ForCausalLMLoss(
            out.logits, None, 32, num_items_in_batch=local["num_items_in_batch"], shift_labels=local["shift_labels"]
        )
        torch.testing.assert_close(out.loss, share, rtol=1e-6, atol=1e-6)
        locally_shifted = ForCausalLMLoss(out.logits, local["labels"], 32)
        assert not torch.allclose(out.loss, locally_shifted)


# ----------------------------------------------------------------------------- unshard (gloo)


def _check_unshard(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    mesh = types.SimpleNamespace(cp_size=world, cp_rank=rank, cp=dm, dp_cp=dm)
    gen = torch.Generator().manual_seed(seed)
    seq_len = 2 * world * 3
    full = torch.randn(2, seq_len, 4, generator=gen)
    weight = torch.randn(2, seq_len, 4, generator=gen)
    for layout in LAYOUTS:
        plan = _plan(layout, world)
        idx = local_indices(seq_len, world, rank, layout)
        local = full[:, idx].clone().requires_grad_(True)
        gathered = unshard(local, mesh, plan)
        torch.testing.assert_close(gathered, full, rtol=0, atol=0)
        (gathered * weight).sum().backward()
        # every rank's loss reads this rank's tokens: gradients from all ranks are summed
        torch.testing.assert_close(local.grad, world * weight[:, idx], rtol=1e-6, atol=1e-6)
        # seq_dim other than 1, and the shard_batch -> unshard round trip
        ids = torch.randint(0, 50, (3, seq_len), generator=gen)
        loc = shard_batch({"input_ids": ids}, mesh, plan)
        assert torch.equal(unshard(loc["input_ids"].t().contiguous(), mesh, plan, seq_dim=0).t(), ids)
        assert torch.equal(unshard(loc["position_ids"], mesh, plan), torch.arange(seq_len).expand(3, -1))
    assert dist.get_world_size() == world


@pytest.mark.parametrize("world", [2, 4])
def test_unshard_restores_global_order(world):
    _launch(_check_unshard, world, int(torch.randint(0, 2**31 - 1, (1,))))


def test_local_compute_fn_override_means_contiguous_and_sizes_must_agree():
    plan = Plan(AcceleratorConfig(cp_size=2), (_override("attn", local_compute_fn="pkg.fn"),))
    local = shard_batch(_batch(1, 8), _mesh(2, 1), plan)
    assert local["position_ids"].tolist() == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match="cp_size=4.*cp_size=2"):
        shard_batch(_batch(1, 8), _mesh(2, 0), _plan(CONTIGUOUS, 4))


def test_user_num_items_and_shift_labels_pass_through():
    batch = _batch(2, 8)
    shifted = batch.pop("labels")
    batch.update(shift_labels=shifted, num_items_in_batch=torch.tensor(99))
    local = shard_batch(batch, _mesh(2, 1), _plan(HEAD_TAIL, 2))
    assert local["num_items_in_batch"].item() == 99
    idx = local_indices(8, 2, 1, HEAD_TAIL)
    assert torch.equal(local["shift_labels"], shifted[:, idx])  # already shifted: not shifted again
    assert torch.equal(local["labels"], local["shift_labels"])  # only there so HF computes a loss


@pytest.mark.parametrize("cp, pad, left, want", [
    (1, 0, False, True), (1, 3, False, True), (1, 3, True, False),  # cp 1: right padding hides nothing causally
    (2, 0, False, True), (2, 3, False, False),                          # CP: any padded key is masked
])
def test_the_unmasked_mark_without_and_with_cp(cp, pad, left, want):
    """The kernels' unmasked fact on the local position ids: under CP strict (no key padded or of
    another document); without CP causal (`documents.causally_unmasked_keys`), as the model's causal
    attention reads it (adapters/hf_attention.py)."""
    from cpcompile.documents import UNMASKED_MARK

    batch = _batch(2, 8, mask_pad=pad)
    if left:
        batch["attention_mask"] = batch["attention_mask"].flip(-1)
    for local in _all_local(batch, cp, CONTIGUOUS):
        assert getattr(local["position_ids"], UNMASKED_MARK) is want
    packed = {"input_ids": torch.randint(1, 11, (1, 8)), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    assert getattr(_all_local(packed, cp, CONTIGUOUS)[0]["position_ids"], UNMASKED_MARK) is False
