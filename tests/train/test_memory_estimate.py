"""`trainer/memory.py` (the dry run's estimate) on the 0.57B Qwen3.5-shaped model of
benchmarks/trainer_gpu.py, built on the meta device: its parameter counts from the config are the
model's, and every H200 measurement of it is met within 10% (issue 32)."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


@pytest.fixture(scope="module")
def model():
    from trainer_gpu import MODEL

    from cpcompile.trainer.parallelize import meta_model

    return meta_model(MODEL)


def _config(cp: int, seq_len: int, loss: str, ac: str = "every_layer", sdpa="sdpa_hf", device: str = "cpu",
            gdn: str = "p2p", **switches):
    from trainer_gpu import config

    from cpcompile.trainer import load_train_config

    args = argparse.Namespace(cp=cp, steps=3, seq_len=seq_len, small=False, device=device, loss_chunk_tokens=4096,
                              gdn_backend=None, **{"compile_backend": None, **switches})
    return load_train_config(config(args, loss, ac, sdpa, gdn))


def test_parameters_counted_from_the_config_are_the_models(model):
    from cpcompile.trainer.memory import root_parameters
    from cpcompile.trainer.memory_layers import layer_kinds, layer_parameters

    text = model.config.get_text_config()
    for index, kind in enumerate(layer_kinds(text)):
        assert layer_parameters(text, kind) == sum(p.numel() for p in model.model.layers[index].parameters())
    assert root_parameters(text) + sum(layer_parameters(text, k) for k in layer_kinds(text)) == \
        sum(p.numel() for p in model.parameters())


# (cp, seq_len, loss, activation checkpointing, SDPA wrapper, peak GiB of the steady-state steps on
# one H200, torch 2.11, eager layers unless named), from benchmarks/results/: 32K
# trainer_gpu_2026-12-02_NVIDIA-H200_compile.md (the compiled loss: trainer_vs_hf_2026-12-03_NVIDIA-H200_step32k.md),
# 64K and 128K ..._chunked-loss.md, the whole logits trainer_gpu_2026-12-01_NVIDIA-H200.md; 512K and
# the lower-memory switches (one step each, AdamW's moments held) longest_2026-12-03_NVIDIA-H200.md
AROUND_CORE = {"gdn_checkpoint_around_core": True}
BOTH = {"gdn_checkpoint_around_core": True, "offload_layer_inputs": True}
H200_PEAKS = [
    (1, 32768, "chunked", "every_layer", "sdpa_hf", 13.95),
    (1, 32768, "chunked", "every_layer", "sdpa_hf", 13.09),  # inductor layers
    (1, 32768, "chunked", "every_layer", "sdpa_hf", 13.34, {"compile_backend": "inductor"}),  # + compiled loss
    (1, 32768, "chunked", "selective", "sdpa_hf", 37.18),
    (1, 32768, "chunked", "selective", "sdpa_hf", 35.93),  # inductor layers
    (1, 65536, "chunked", "every_layer", "sdpa_hf", 20.12),
    (1, 131072, "chunked", "every_layer", "sdpa_hf", 33.04),
    (1, 32768, "full", "every_layer", "sdpa_hf", 63.98),
    (1, 1 << 19, "chunked", "every_layer", "sdpa_hf", 110.56),
    # both switches set, the offload inert then (its hooks kept each input alive): the around-core switch alone
    (1, 1 << 17, "chunked", "every_layer", "sdpa_hf", 25.56, AROUND_CORE),
    (1, 1 << 19, "chunked", "every_layer", "sdpa_hf", 80.59, AROUND_CORE),
    (1, 3 << 18, "chunked", "every_layer", "sdpa_hf", 117.27, AROUND_CORE),
    (1, 1 << 17, "chunked", "every_layer", "sdpa_hf", 22.22, BOTH),  # the offload fixed
    (1, 1 << 20, "chunked", "every_layer", "sdpa_hf", 117.36, BOTH),  # 1M, the fixed offload (one step)
]
H200_PEAKS = [row if len(row) == 7 else (*row, {}) for row in H200_PEAKS]  # the switches: none


@pytest.mark.parametrize("cp, seq_len, loss, ac, sdpa, peak, switches", H200_PEAKS)
def test_the_h200_measurements(model, cp, seq_len, loss, ac, sdpa, peak, switches):
    from cpcompile.trainer.dry_run_report import memory_estimate

    params = sum(p.numel() for p in model.parameters())
    estimate = memory_estimate(_config(cp, seq_len, loss, ac, sdpa, **switches), params, model.config)
    assert abs(estimate["total"] / peak - 1) < 0.10, estimate


# (cp, global tokens, SDPA wrapper, rank, peak GiB): one rank of a CP job on one H200 under the fake
# process group (`trainer_gpu.py --simulate-cp`), GDN State-P2P, the chunked loss, every layer
# checkpointed, eager layers; simulate_cp_2026-12-02_NVIDIA-H200.md and ..._2026-12-03_NVIDIA-H200.md
K = 1024
SIMULATED_PEAKS = [
    (2, 128 * K, "sdpa_hf", 0, 17.10), (2, 128 * K, "sdpa_hf", 1, 17.10),
    (4, 128 * K, "sdpa_hf", 0, 8.98), (4, 128 * K, "sdpa_hf", 3, 8.98), (4, 256 * K, "sdpa_hf", 0, 15.51),
    (8, 128 * K, "sdpa_hf", 0, 6.12), (8, 128 * K, "sdpa_hf", 7, 6.09),
    (8, 256 * K, "sdpa_hf", 0, 8.09), (8, 256 * K, "sdpa_hf", 7, 9.64),
    (8, 512 * K, "sdpa_hf", 0, 14.56), (8, 512 * K, "sdpa_hf", 7, 17.73),
    (16, 128 * K, "sdpa_hf", 0, 5.28), (16, 128 * K, "sdpa_hf", 15, 5.28),
    (16, 256 * K, "sdpa_hf", 0, 5.67), (16, 256 * K, "sdpa_hf", 15, 7.98),
    (16, 512 * K, "sdpa_hf", 0, 7.68), (16, 512 * K, "sdpa_hf", 15, 14.73),
    (4, 128 * K, "sdpa_hf_ulysses", 0, 8.91),
    (8, 128 * K, "sdpa_hf_ulysses", 0, 6.08), (8, 128 * K, "sdpa_hf_ulysses", 7, 6.08),
    (8, 1024 * K, "sdpa_hf_ulysses", 0, 27.49), (8, 1024 * K, "sdpa_hf_ulysses", 7, 27.77),
    # 2026-12-03, the grid's further cells (simulate_cp_2026-12-03_NVIDIA-H200_grid.md)
    (2, 256 * K, "sdpa_hf", 0, 29.88), (2, 256 * K, "sdpa_hf", 1, 29.88), (2, 512 * K, "sdpa_hf", 0, 55.72),
    (4, 256 * K, "sdpa_hf", 3, 15.37), (4, 512 * K, "sdpa_hf", 0, 28.29), (4, 512 * K, "sdpa_hf", 3, 28.29),
    (8, 1024 * K, "sdpa_hf", 0, 27.49), (8, 1024 * K, "sdpa_hf", 7, 35.63),
    (16, 1024 * K, "sdpa_hf", 0, 14.15), (16, 1024 * K, "sdpa_hf", 15, 30.20),
    (2, 128 * K, "sdpa_hf_ulysses", 0, 16.96), (2, 128 * K, "sdpa_hf_ulysses", 1, 16.96),
    (2, 256 * K, "sdpa_hf_ulysses", 0, 29.88), (2, 256 * K, "sdpa_hf_ulysses", 1, 29.88),
    (4, 128 * K, "sdpa_hf_ulysses", 3, 8.91),
    (4, 256 * K, "sdpa_hf_ulysses", 0, 15.37), (4, 256 * K, "sdpa_hf_ulysses", 3, 15.37),
    (4, 512 * K, "sdpa_hf_ulysses", 0, 28.29), (4, 512 * K, "sdpa_hf_ulysses", 3, 28.29),
    (8, 256 * K, "sdpa_hf_ulysses", 0, 8.09), (8, 256 * K, "sdpa_hf_ulysses", 7, 8.10),
    (8, 512 * K, "sdpa_hf_ulysses", 0, 14.56), (8, 512 * K, "sdpa_hf_ulysses", 7, 14.56),
    # the same file's second part: N=2 at 512K and 1M, N=4 at 1M
    (2, 512 * K, "sdpa_hf", 1, 55.72), (2, 1024 * K, "sdpa_hf", 0, 107.41), (2, 1024 * K, "sdpa_hf", 1, 107.41),
    (4, 1024 * K, "sdpa_hf", 0, 54.14),
    (2, 512 * K, "sdpa_hf_ulysses", 0, 55.72), (2, 512 * K, "sdpa_hf_ulysses", 1, 55.72),
    (4, 1024 * K, "sdpa_hf_ulysses", 0, 54.14),
    # its third part (2026-12-04): the last rank of N=4 and both of Ulysses N=2, at 1M
    (4, 1024 * K, "sdpa_hf", 3, 54.14), (4, 1024 * K, "sdpa_hf_ulysses", 3, 54.14),
    (2, 1024 * K, "sdpa_hf_ulysses", 0, 107.40), (2, 1024 * K, "sdpa_hf_ulysses", 1, 107.41),
]


@pytest.mark.parametrize("cp, tokens, sdpa, rank, peak", SIMULATED_PEAKS)
def test_the_h200_measurements_of_one_cp_rank(model, cp, tokens, sdpa, rank, peak, monkeypatch):
    """Rank by rank: under AllGather the last rank's attention reads every other rank's keys in one
    kernel call (cuDNN: K/V repeated per query head), 7 GiB more than rank 0 at CP=16 and 512K.
    Measured before the loss's Triton chunk kernels: its chunk work was the ATen sequence then."""
    from cpcompile.trainer import memory
    from cpcompile.trainer.dry_run_report import memory_estimate

    monkeypatch.setattr(memory, "_loss_chunk_work", lambda *args: "eager")

    params = sum(p.numel() for p in model.parameters())
    config = _config(cp, tokens, "chunked", sdpa=sdpa, device="cuda")
    estimate = memory_estimate(config, params, model.config, rank=rank)
    assert abs(estimate["total"] / peak - 1) < 0.10, estimate


def test_the_dry_run_estimate_is_the_busiest_ranks(model):
    """Without a rank the estimate is the job's peak: AllGather's last rank, Head-Tail's first
    (its tail chunk follows every other chunk); an estimate for a rank outside the job is refused."""
    from cpcompile.trainer.dry_run_report import memory_estimate
    from cpcompile.trainer.memory import busiest_rank
    from cpcompile.trainer.memory_layers import attended_keys

    params = sum(p.numel() for p in model.parameters())
    gather = _config(16, 512 * K, "chunked", device="cuda")
    by_rank = [memory_estimate(gather, params, model.config, rank=r)["total"] for r in range(16)]
    assert by_rank == sorted(by_rank) and by_rank[-1] > 1.5 * by_rank[0]
    assert memory_estimate(gather, params, model.config)["total"] == by_rank[-1]
    with pytest.raises(ValueError, match="rank 16"):
        memory_estimate(gather, params, model.config, rank=16)
    # Head-Tail (not for this hybrid model: it cannot share a plan with GDN) reads the most on rank 0
    head_tail = [attended_keys("head_tail", 4, r) for r in range(4)]
    assert head_tail == sorted(head_tail, reverse=True) and busiest_rank("head_tail", 4) == 0
    assert busiest_rank("all_gather", 4) == 3 and attended_keys("ulysses", 4, 2) == 1


def test_the_peak_is_one_moment_of_the_backward_not_the_sum_of_the_terms(model):
    """At 32K with every layer checkpointed the gradients of the layers above outweigh what the
    layers below keep: the peak is the first layer's backward, where almost every gradient and
    almost no activation is alive; at 128K it is near the top of the stack."""
    from cpcompile.trainer.memory import _terms_and_moments

    params = sum(p.numel() for p in model.parameters())
    for seq_len, where in ((32768, "layer 0 backward"), (131072, "layer 18 backward")):
        terms, moments = _terms_and_moments(_config(1, seq_len, "chunked"), params, model.config, rank=0)
        assert max(moments, key=moments.get) == where, moments
        assert max(moments.values()) < terms["states"] + terms["activations"] + terms["layer_backward"]


def test_terms_follow_the_mesh_and_the_modes(model):
    from cpcompile.trainer.dry_run_report import memory_estimate

    params = sum(p.numel() for p in model.parameters())
    one = memory_estimate(_config(1, 32768, "chunked"), params, model.config)
    two = memory_estimate(_config(2, 65536, "chunked"), params, model.config)  # the same tokens a rank
    assert two["states"] == pytest.approx(one["states"] / 2)
    assert two["total"] < one["total"]
    off = memory_estimate(_config(1, 32768, "chunked", ac="off"), params, model.config)
    assert off["activations"] > 10 * one["activations"] and off["total"] > one["total"]
    full = memory_estimate(_config(1, 32768, "full"), params, model.config)
    assert full["loss"] > 5 * one["loss"]


def test_a_compiled_chunked_loss_holds_its_logit_gradient_in_the_compute_dtype(model):
    """With a compile backend the chunk's float copy is fused away: in bfloat16 the loss term is one
    chunk x vocabulary x 2 bytes smaller."""
    from cpcompile.trainer.dry_run_report import memory_estimate

    params = sum(p.numel() for p in model.parameters())
    eager = memory_estimate(_config(1, 32768, "chunked"), params, model.config)
    compiled = memory_estimate(_config(1, 32768, "chunked", compile_backend="inductor"), params, model.config)
    assert eager["loss"] - compiled["loss"] == pytest.approx(4096 * 151936 * 2 / 2**30)


def test_allgather_keeps_the_other_ranks_keys_and_values(model):
    from cpcompile.trainer.memory_layers import ElementSizes, layer_saved_bytes

    text, bf16 = model.config.get_text_config(), ElementSizes(param=4, compute=2, reduce=4)
    local = layer_saved_bytes(text, "full_attention", bf16, 1, "all_gather")
    kv = text.num_key_value_heads * text.head_dim
    for cp in (2, 4, 16):
        assert layer_saved_bytes(text, "full_attention", bf16, cp, "all_gather") - local == 2 * kv * 2 * (cp - 1)
    # Ulysses over 8 ranks with 2 KV heads: each KV head copied 4 times before the exchange
    assert layer_saved_bytes(text, "full_attention", bf16, 8, "ulysses") - local == 2 * kv * 2 * 3


def test_the_checkpointing_modes_order_the_activations(model):
    """Layer by layer as each mode picks them: every layer < every second layer < none; selective
    keeps more than a checkpointed layer's input and less than a layer left alone, and its replay
    (what it recomputes) is smaller than a whole layer's."""
    from cpcompile.trainer.dry_run_report import memory_estimate

    params = sum(p.numel() for p in model.parameters())
    every, second, selective, off = (memory_estimate(_config(1, 32768, "chunked", ac=ac), params, model.config)
                                     for ac in ("every_layer", {"every_n": 2}, "selective", "off"))
    assert every["activations"] < second["activations"] < off["activations"]
    assert every["activations"] < selective["activations"] < off["activations"]
    assert selective["layer_backward"] < every["layer_backward"]
    assert off["layer_backward"] < every["layer_backward"]


def test_the_lower_memory_switches_take_off_what_they_move(model):
    """`offload_layer_inputs` takes every checkpointed layer's kept input off the device (the final
    norm's saved tensors stay); `gdn_checkpoint_around_core` takes the GDN replay's saved conv, q/k
    and gated-norm copies off each GDN layer's peak (measured 170 -> 110 KB a token, the core's
    moment then the larger). At 1M tokens, cp 1, both together put the peak under the H200's
    139.8 GiB, neither alone does."""
    import dataclasses

    from cpcompile.trainer.dry_run_report import memory_estimate
    from cpcompile.trainer.memory_layers import ElementSizes, final_norm_bytes

    params, text = sum(p.numel() for p in model.parameters()), model.config.get_text_config()
    tokens = 1 << 20
    plain = _config(1, tokens, "chunked")

    def estimate(**switches) -> dict:
        config = dataclasses.replace(plain, train=dataclasses.replace(plain.train, **switches))
        return memory_estimate(config, params, model.config)

    base, offload = estimate(), estimate(offload_layer_inputs=True)
    inner, both = estimate(gdn_checkpoint_around_core=True), estimate(offload_layer_inputs=True,
                                                                      gdn_checkpoint_around_core=True)
    final_norm = final_norm_bytes(text, ElementSizes(param=4, compute=2, reduce=4)) * tokens / 2 ** 30
    assert offload["activations"] == pytest.approx(final_norm)
    assert base["activations"] - offload["activations"] == pytest.approx(text.num_hidden_layers * text.hidden_size
                                                                         * 2 * tokens / 2 ** 30)
    assert base["layer_backward"] - inner["layer_backward"] == pytest.approx(60 * 1024 * tokens / 2 ** 30, rel=0.02)
    assert min(base["total"], offload["total"], inner["total"]) > 139.8 > both["total"]


def test_the_longest_length_that_fits_is_where_the_estimate_crosses_the_budget(model):
    """`memory.longest_seq_len` (the dry run's `--memory-gib`): at the H200's 139.8 GiB the estimate
    fits the length it names and not one token more; each lower-memory switch lengthens it."""
    from cpcompile.trainer.memory import longest_seq_len, total_at_length

    params = sum(p.numel() for p in model.parameters())
    longest = {}
    for name, switches in {"plain": {}, "around": AROUND_CORE, "both": BOTH}.items():
        config = _config(1, 1 << 15, "chunked", **switches)
        longest[name] = longest_seq_len(config, params, model.config, 139.8, 1)
        at, past = (total_at_length(config, params, model.config, n) for n in (longest[name], longest[name] + 1))
        assert at <= 139.8 < past, name
    assert longest["plain"] < longest["around"] < longest["both"], longest


def test_the_dry_run_names_the_rank_imbalance(model):
    """Per CP rank (trainer/balance.py): under SDPA AllGather the last rank's attention grows with its
    place; the expected step-time ratios meet the four H200 measurements of issue 49 within 5%
    (FLOPs weighted by the fit of that module). SDPA Head-Tail with GDN in Head-Tail order, or
    Ulysses, give every rank the same work."""
    from cpcompile.trainer.balance import describe_imbalance, imbalance

    params = sum(p.numel() for p in model.parameters())
    for cp, tokens, measured in ((8, 512 * K, 4.4), (8, 1024 * K, 6.3), (16, 512 * K, 5.3), (16, 1024 * K, 8.3)):
        found = imbalance(_config(cp, tokens, "chunked"), params, model.config)
        assert (found.busiest, found.idlest) == (cp - 1, 0) and found.flops > found.time, found
        assert abs(found.time / measured - 1) < 0.05, (cp, tokens, found)
    head_tail = _config(8, 512 * K, "chunked", sdpa={"_target_": "cpcompile.wrappers.sdpa_hf_load_balance_cp_wrapper"},
                        gdn="p2p_head_tail")
    assert imbalance(head_tail, params, model.config).time == pytest.approx(1.0)
    assert imbalance(_config(8, 512 * K, "chunked", sdpa="sdpa_hf_ulysses"), params, model.config).time == \
        pytest.approx(1.0)
    line = describe_imbalance(_config(8, 512 * K, "chunked"), params, model.config)
    assert "busiest CP rank 7 / least busy rank 0 = 4.41x expected step time (9.10x FLOPs" in line, line


def test_head_tail_gdn_adds_its_gradient_copy_to_the_core_backward(model):
    """GDN in Head-Tail order (beside SDPA Head-Tail: one batch order) holds the fragments' input
    gradients beside their concatenation (memory_layers.gdn_head_tail_backward_bytes): a GDN layer's
    backward peak grows by at most that, here by some (its core's moment passes its MLP's)."""
    from cpcompile.trainer.memory_layers import ElementSizes, gdn_head_tail_backward_bytes, layer_peak_bytes

    text, sizes = model.config.get_text_config(), ElementSizes(4, 2, 4)
    peak = {sdpa: layer_peak_bytes(text, "linear_attention", sizes, 8, sdpa, "checkpointed")
            for sdpa in ("all_gather", "head_tail")}
    grown = peak["head_tail"] - peak["all_gather"]
    assert 0 < grown <= gdn_head_tail_backward_bytes(text, sizes), (peak, grown)
