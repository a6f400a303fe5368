"""Issue 52 item 1: the suggested plan's choices are the documented ones (cpcompile/suggest/choose.py)
for a table of (heads, cp, length) cases; cores are found by running the model; what no method runs
is named; bad arguments are refused; the byte formulas are what a rank sends (one process under the
fake process group)."""
from __future__ import annotations

import pytest
import torch
import yaml

import cpcompile
from cpcompile.suggest.choose import WORTH_BALANCING, decide, gather_elements, ulysses_elements
from cpcompile.suggest.sites import GDN, SDPA, CoreSite, find_core_sites
from cp_harness import tiny_llama, tiny_qwen3
from gdn_harness import tiny_qwen3_5

PARAMS = 570_000_000  # the 0.57B Qwen3.5-shaped model of benchmarks/trainer_gpu.py


def attention(q_heads: int, kv_heads: int, layers: int = 5, causal: bool = True, window=None) -> list[CoreSite]:
    return [CoreSite(SDPA, f"model.layers.{i}.self_attn", "Attention", q_heads, kv_heads, 256, causal, window)
            for i in range(layers)]


def gdn(layers: int = 15) -> list[CoreSite]:
    return [CoreSite(GDN, f"model.layers.{i}.linear_attn", "GatedDeltaNet", 32, 16, 128, conv_halo=3)
            for i in range(layers)]


def methods(sites, cp, seq_len, params=PARAMS) -> tuple[str, dict]:
    decision = decide(sites, cp, seq_len, params)
    return decision.layout, {c.site.fqn.rsplit(".", 1)[-1]: c.method for c in decision.choices}


# (case, sites, cp, seq_len) -> (layout, {module name: method})
TABLE = [
    ("GQA 8/2 at 32K: Ulysses sends more, contiguous unbalanced", attention(8, 2), 2, 32768,
     ("head_tail", {"self_attn": "head_tail"})),
    ("MHA 32/32 at CP=4: Ulysses sends half", attention(32, 32), 4, 32768, ("contiguous", {"self_attn": "ulysses"})),
    ("MHA 16/16 at CP=2: a tie, the gather wins", attention(16, 16), 2, 32768, ("head_tail", {"self_attn": "head_tail"})),
    ("6 query heads do not split over 4 ranks", attention(6, 6), 4, 32768, ("head_tail", {"self_attn": "head_tail"})),
    ("KV heads neither divide nor are divided by cp", attention(12, 3), 4, 32768,
     ("head_tail", {"self_attn": "head_tail"})),
    ("short sequence: the ranks stay balanced", attention(8, 2), 2, 512, ("contiguous", {"self_attn": "all_gather"})),
    ("bidirectional attention: AllGather", attention(8, 8, causal=False), 4, 32768,
     ("contiguous", {"self_attn": "all_gather"})),
    ("hybrid at 32K: Head-Tail, GDN in Head-Tail order", gdn() + attention(8, 2), 8, 32768,
     ("head_tail", {"linear_attn": "p2p_head_tail", "self_attn": "head_tail"})),
    ("hybrid, short: contiguous, State-P2P", gdn() + attention(8, 2), 2, 1024,
     ("contiguous", {"linear_attn": "p2p", "self_attn": "all_gather"})),
    ("hybrid, Head-Tail chunks shorter than the conv halo", gdn() + attention(8, 2, layers=20), 8, 32,
     ("contiguous", {"linear_attn": "p2p", "self_attn": "all_gather"})),
    ("a window shorter than the sequence: no method", attention(8, 2, window=4096), 2, 32768,
     ("contiguous", {"self_attn": None})),
    ("a window covering the sequence is causal attention", attention(8, 2, window=65536), 2, 32768,
     ("head_tail", {"self_attn": "head_tail"})),
    ("one rank", gdn() + attention(8, 2), 1, 32768, ("contiguous", {"linear_attn": "p2p", "self_attn": "all_gather"})),
]


@pytest.mark.parametrize("case, sites, cp, seq_len, expected", TABLE, ids=[row[0] for row in TABLE])
def test_the_documented_choice(case, sites, cp, seq_len, expected):
    assert methods(sites, cp, seq_len) == expected


def test_head_tail_exactly_when_contiguous_shards_are_unbalanced():
    sites = attention(8, 2)
    lengths = [2 ** k for k in range(6, 20)]
    for seq_len in lengths:
        contiguous = decide(sites, 4, seq_len, PARAMS)
        if contiguous.layout == "contiguous":
            assert contiguous.imbalance <= WORTH_BALANCING, seq_len
        else:
            assert contiguous.imbalance == pytest.approx(1.0), seq_len  # Head-Tail: every rank alike
    assert {decide(sites, 4, n, PARAMS).layout for n in lengths} == {"contiguous", "head_tail"}


def test_the_byte_formulas():
    """Rule 2's counts: gathering K/V is 4 (cp-1) KV heads L D; Ulysses 2 (cp-1)/cp (2 Q + 2 max(KV, cp)) L D."""
    site = attention(8, 2)[0]
    assert gather_elements(site, 4, 100) == 4 * 3 * 2 * 100 * 256
    assert ulysses_elements(site, 4, 100) == 2 * 3 / 4 * (16 + 8) * 100 * 256


LOCAL = 16  # tokens a rank in the byte counts


def _counted_bytes(_process: int, _processes: int) -> dict:
    """Bytes rank 1 sends in one forward and backward of a 2-layer Qwen3 (4 query / 2 KV heads) under
    AllGather and Ulysses, at cp 2 and 4 (the fake process group: shapes as on real ranks)."""
    import sys
    from pathlib import Path

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from cp_harness import VOCAB, random_batch, sdpa_plan

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from collective_bytes import CollectiveBytes

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa")
    out = {}
    for cp in (2, 4):
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=cp)
        for method, wrapper in (("all_gather", "sdpa_hf"), ("ulysses", "sdpa_hf_ulysses")):
            plan = cpcompile.load_plan(sdpa_plan(cp, wrapper=wrapper))
            mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
            batch = cpcompile.shard_batch(random_batch(0, 1, LOCAL * cp, padded=False), mesh, plan)
            torch.manual_seed(0)
            model = cpcompile.compile(Qwen3ForCausalLM(config), mesh, plan, example_inputs=batch)
            with CollectiveBytes() as sent:
                model(**batch).loss.backward()
            out[method, cp] = (sent.total, find_core_sites(Qwen3ForCausalLM(config))[0])
        dist.destroy_process_group()
    return out


def test_the_byte_formulas_are_what_the_ranks_send():
    """Rule 2's counts against the bytes a rank's collectives send (benchmarks/collective_bytes.py),
    float32, per layer: the formula's K/V (AllGather) or Q/K/V/out (Ulysses) elements, plus the
    gather of the local position ids (int64), which the formulas leave out as a token's 8 bytes."""
    from dist_utils import run_distributed

    (counted,) = run_distributed(_counted_bytes, 1, init_pg=False, timeout=300)
    formulas = {"all_gather": gather_elements, "ulysses": ulysses_elements}
    for (method, cp), (sent, site) in counted.items():
        positions = (cp - 1) * LOCAL * 8
        assert sent == 2 * (4 * formulas[method](site, cp, LOCAL) + positions), (method, cp, sent)


def test_cores_are_found_by_running_the_model_even_on_the_meta_device():
    model = tiny_qwen3_5(0)
    sites = find_core_sites(model)
    assert [(s.kind, s.fqn) for s in sites] == [
        ("gdn", "model.layers.0.linear_attn"), ("gdn", "model.layers.1.linear_attn"),
        ("gdn", "model.layers.2.linear_attn"), ("sdpa", "model.layers.3.self_attn")]
    config = model.config
    assert (sites[-1].q_heads, sites[-1].kv_heads) == (config.num_attention_heads, config.num_key_value_heads)
    assert sites[0].conv_halo == config.linear_conv_kernel_dim - 1
    with torch.device("meta"):
        on_meta = type(model)(config)
    for buffer_owner in on_meta.modules():  # the rotary frequencies as a real build has them
        for name, buffer in list(buffer_owner.named_buffers(recurse=False)):
            buffer_owner.register_buffer(name, torch.zeros(buffer.shape, dtype=buffer.dtype), persistent=False)
    assert find_core_sites(on_meta) == sites


def test_the_text_is_the_plan_with_its_reasons():
    suggestion = cpcompile.suggest_plan(tiny_qwen3_5(0), 2, 32768)
    assert yaml.safe_load(suggestion.text) == suggestion.plan
    cpcompile.load_plan(suggestion.plan)
    assert "Head-Tail: contiguous shards would leave the busiest rank" in suggestion.text
    assert "State-P2P in Head-Tail order" in suggestion.text
    assert "rank 1: work 1.00x" in suggestion.text and "GiB" in suggestion.text


def test_a_module_no_method_runs_is_named():
    model = tiny_qwen3(0, use_sliding_window=True, sliding_window=8, max_window_layers=1)  # layer 0 full, 1 sliding
    suggestion = cpcompile.suggest_plan(model, 2, 64)
    assert [c.site.fqn for c in suggestion.uncovered] == ["model.layers.1.self_attn"]
    assert "NOT COVERED: model.layers.1.self_attn" in suggestion.text
    assert "sliding window of 8 tokens" in suggestion.text
    # `*.self_attn` would match the sliding layer too: the covered one is named alone
    assert [o["match"] for o in suggestion.plan["plan_overrides"]] == ["model.layers.0.self_attn"]


@pytest.mark.parametrize("cp, seq_len, backend, words", [
    (0, 64, "eager", "cp must be a positive int"),
    (2, 3, "eager", "seq_len must be an int of at least 2 x cp = 4"),
    (2, 64, "cuda", "gdn_backend must be 'eager' or 'triton'"),
])
def test_bad_arguments_are_refused(cp, seq_len, backend, words):
    with pytest.raises(cpcompile.CPInputError, match=words):
        cpcompile.suggest_plan(tiny_llama(0), cp, seq_len, gdn_backend=backend)


def test_a_model_without_sdpa_attention_is_refused():
    model = tiny_llama(0)
    model.config._attn_implementation = "eager"
    with pytest.raises(cpcompile.CPInputError, match='runs no attention core.*attn_implementation="sdpa"'):
        cpcompile.suggest_plan(model, 2, 64)
