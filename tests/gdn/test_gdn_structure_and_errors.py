"""GDN CP under the fake process group: collectives per method (forward and backward, identical
on every rank), the dump, and one test per GDN fail-fast rule."""
from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from cp_harness import HEAD_TAIL_WRAPPER, assert_fails_with
from gdn_harness import TEXT, gdn_plan, gdn_wrapper, tiny_qwen3_5
from dist_utils import run_distributed

WORLD = 4
_cache: dict = {}


def _fake_pg(rank: int, world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _structure(rank: int, world: int, dump_root: str) -> dict:
    import torch.distributed as dist

    import cpcompile
    from cp_harness import random_batch

    _fake_pg(rank, world)
    result = {}
    for method in ("ulysses", "p2p", "all_gather", "p2p_head_tail", "all_gather_head_tail"):
        sdpa = HEAD_TAIL_WRAPPER if method.endswith("head_tail") else "sdpa_hf"
        plan = cpcompile.load_plan(gdn_plan(world, method, sdpa=sdpa))
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
        local = cpcompile.shard_batch(random_batch(rank, 2, 8 * world, padded=True), mesh, plan)
        dump = f"{dump_root}/{method}"  # compile writes <dump>/rank<r>
        model = cpcompile.compile(tiny_qwen3_5(0), mesh, plan, example_inputs=local, dump_dir=dump)

        with collective_log() as forward:
            out = model(**local)
        with collective_log() as backward:
            out.loss.backward()
        summary = json.loads(open(f"{dump}/rank{rank}/summary.json").read())
        gdn = [r for r in summary["regions"] if r["core"] == "gdn"]
        result[method] = {
            "forward": forward,
            "backward": backward,
            "gdn_purposes": [c["purpose"] for c in gdn[0]["collectives_inserted"]],
            "dump": {(r["fqn"], r["method"], r["backend"]) for r in gdn},
            "notes": gdn[0]["notes"],
            "sdpa_notes": [n for r in summary["regions"] if r["core"] == "sdpa" for n in r["notes"]],
        }
    dist.destroy_process_group()
    return result


@contextmanager
def collective_log():
    """Names of the collective launches run inside the block, in order (from the profiler:
    a dispatch mode would also intercept the functorch transform inside the GDN backward).
    Read from kineto's raw events: `prof.events()` would build every op's FunctionEvent tree in
    Python first (6.7 s of the 17 s of CPU a rank spends in `_structure`), for the same names in
    the same order."""
    calls: list[str] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield calls
    names = [e.name() for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())]
    calls.extend(n.split("::")[1] for n in names
                 if n.startswith(("_c10d_functional::", "_c10d_functional_autograd::")) and "wait" not in n)


def structure(tmp_path_factory):
    if "structure" not in _cache:
        root = str(tmp_path_factory.mktemp("gdn_dump"))
        _cache["structure"] = run_distributed(_structure, WORLD, root, init_pg=False, timeout=600)
    return _cache["structure"]


EXPECTED_GDN = {
    "ulysses": ["conv halo"] + [f"{x} seq->head" for x in ("q", "k", "v", "g", "beta")] + ["o head->seq"],
    "p2p": ["conv halo"] + [f"state chain step {i}/{WORLD - 1}" for i in range(1, WORLD)],
    "all_gather": ["conv halo", "summary M", "summary S"],
    # Head-Tail order: one halo exchange with both neighbours; the state up the heads, down the tails
    "p2p_head_tail": ["conv halo"] + [f"{part} state chain step {i}/{WORLD - 1}" for part in ("head", "tail")
                                      for i in range(1, WORLD)],
    "all_gather_head_tail": ["conv halo", "summary M", "summary S"],
}


@pytest.mark.parametrize("method", sorted(EXPECTED_GDN))
def test_gdn_collectives_per_method(method, tmp_path_factory):
    results = structure(tmp_path_factory)
    for rank, result in enumerate(results):
        r = result[method]
        purposes = [p.split(" (")[0] for p in r["gdn_purposes"]]
        assert purposes == EXPECTED_GDN[method], f"rank {rank}: {purposes}"
        assert r["forward"] == results[0][method]["forward"], "forward collectives differ between ranks"
        assert r["backward"] == results[0][method]["backward"], "backward collectives differ between ranks"
        assert {fqn for fqn, _, _ in r["dump"]} == {f"model.layers.{i}.linear_attn" for i in range(3)}
        assert all(m == method and b == "eager" for _, m, b in r["dump"])
        if method.endswith("head_tail"):  # SDPA Head-Tail beside it: one batch order
            assert any("head-tail" in note for note in r["sdpa_notes"]), r["sdpa_notes"]
        assert any("conv halo" in note for note in r["notes"])


def test_p2p_backward_runs_the_state_gradient_chain(tmp_path_factory):
    for result in structure(tmp_path_factory):
        backward = result["p2p"]["backward"]
        # per GDN layer: the halo and WORLD-1 chain steps come back as all-to-alls
        assert backward.count("all_to_all_single") == 3 * WORLD
        # Head-Tail order: the halo and 2(WORLD-1) chain steps
        assert result["p2p_head_tail"]["backward"].count("all_to_all_single") == 3 * (2 * WORLD - 1)


# ----------------------------------------------------------------------------- fail-fast rules


def _errors(rank: int, world: int) -> dict:
    import cpcompile
    from gdn_harness import gdn_layer

    _fake_pg(0, 2)
    mesh = cpcompile.build_mesh(cpcompile.AcceleratorConfig(cp_size=2), device_type="cpu")
    ids = {"input_ids": torch.randint(0, 96, (1, 16)), "position_ids": torch.arange(16)[None], "use_cache": False}
    outcomes = {}

    def record(name, fn):
        try:
            fn()
            outcomes[name] = None
        except Exception as exc:
            outcomes[name] = (type(exc).__name__, str(exc))

    def compile_model(plan, model=None, example=ids):
        return cpcompile.compile(model or tiny_qwen3_5(0), mesh, plan, example_inputs=example)

    def ulysses_heads():
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(**{**TEXT, "linear_num_key_heads": 1, "linear_num_value_heads": 3},
                                   attn_implementation="sdpa")
        compile_model(gdn_plan(2, "ulysses", sdpa="sdpa_hf"), model=Qwen3_5ForCausalLM(config))

    def with_cache():
        model = compile_model(gdn_plan(2, "p2p", sdpa="sdpa_hf"))
        model(input_ids=ids["input_ids"], position_ids=torch.arange(16)[None], use_cache=True)  # rank 0's slice

    def packed():
        holder = cpcompile.compile(gdn_layer(0, torch.float32), mesh, gdn_plan(2, "p2p", match="layer"),
                                   example_inputs=(torch.randn(1, 8, 32), None))
        holder.layer(torch.randn(1, 8, 32), attention_mask=None, cu_seq_lens_q=torch.tensor([0, 4, 8]))

    def short():
        cpcompile.compile(gdn_layer(0, torch.float32), mesh, gdn_plan(2, "p2p", match="layer"),
                          example_inputs=(torch.randn(1, 2, 32), None))

    def short_fragment():  # 8 local tokens: two fragments of 4; 4 local: of 2, under the halo
        cpcompile.compile(gdn_layer(0, torch.float32), mesh, gdn_plan(2, "p2p_head_tail", match="layer"),
                          example_inputs=(torch.randn(1, 4, 32), None))

    def odd_local_length():  # two fragments a rank need an even local length
        cpcompile.compile(gdn_layer(0, torch.float32), mesh, gdn_plan(2, "p2p_head_tail", match="layer"),
                          example_inputs=(torch.randn(1, 9, 32), None))

    def twice():
        model = compile_model(gdn_plan(2, "p2p", sdpa="sdpa_hf"))
        compile_model(gdn_plan(2, "p2p", sdpa="sdpa_hf"), model=model)

    def sdpa_method_on_gdn():
        plan = gdn_plan(2, "p2p", sdpa="sdpa_hf")
        plan["plan_overrides"][0]["inner_wrapper"] = "sdpa_hf"
        compile_model(plan)

    record("ulysses_heads", ulysses_heads)
    record("inference_cache", with_cache)
    record("packed", packed)
    record("shorter_than_halo", short)
    record("fragment_shorter_than_halo", short_fragment)
    record("head_tail_odd_local_length", odd_local_length)
    record("twice", twice)
    record("tp_with_gdn", lambda: compile_model(dict(gdn_plan(2, "p2p", sdpa="sdpa_hf"),
                                                     accelerator={"cp_size": 2, "tp_size": 2})))
    record("uncovered_gdn", lambda: compile_model(gdn_plan(2, "p2p", sdpa="sdpa_hf", match="*.0.linear_attn")))
    record("sdpa_method_on_gdn", sdpa_method_on_gdn)
    record("all_gather_triton", lambda: cpcompile.load_plan(gdn_plan(2, "all_gather", backend="triton")))
    record("all_gather_head_tail_triton",
           lambda: cpcompile.load_plan(gdn_plan(2, "all_gather_head_tail", backend="triton")))
    record("bad_backend", lambda: cpcompile.load_plan(gdn_plan(2, "p2p", backend="cuda")))
    record("bad_chunk", lambda: cpcompile.load_plan(
        {"plan_overrides": [{"match": "x", "when": "cp", "region_dispatch": False,
                             "inner_wrapper": dict(gdn_wrapper("p2p"), chunk_size=0)}]}))
    def library_forward_never_runs():
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        original = Qwen3_5GatedDeltaNet.forward

        def crash(*args, **kwargs):  # what a kernel-hub dispatch that cannot run here would do
            raise RuntimeError("library GDN forward ran")

        Qwen3_5GatedDeltaNet.forward = crash
        try:
            compile_model(gdn_plan(2, "p2p", sdpa="sdpa_hf"))
        finally:
            Qwen3_5GatedDeltaNet.forward = original

    record("library_forward_never_runs", library_forward_never_runs)
    plan1 = cpcompile.load_plan(gdn_plan(1, "p2p", sdpa="sdpa_hf"))
    model1 = tiny_qwen3_5(0)
    cpcompile.compile(model1, type("Cp1", (), {"cp_size": 1})(), plan1)
    outcomes["cp1_untouched"] = all("forward" not in vars(m) for m in model1.modules())
    return outcomes


def errors():
    if "errors" not in _cache:
        (_cache["errors"],) = run_distributed(_errors, 1, init_pg=False, timeout=300)
    return _cache["errors"]


@pytest.mark.parametrize("name, kind, words", [
    ("ulysses_heads", "CPInputError", ["key heads (1)", "value heads (3)", "cp_size=2", "State-P2P"]),
    ("inference_cache", "CPInputError", ["cache", "use_cache=False"]),
    ("packed", "CPInputError", ["cu_seq_lens_q", "packed"]),
    ("shorter_than_halo", "CPInputError", ["local sequence length 2", "conv halo (3 tokens)"]),
    ("fragment_shorter_than_halo", "CPInputError", ["Head-Tail fragment of 2 tokens", "conv halo (3 tokens)"]),
    ("head_tail_odd_local_length", "CPInputError", ["Head-Tail order needs an even local sequence length", "got 9",
                                                    "multiple of 2*cp_size=4"]),
    ("twice", "AlreadyCompiledError", ["already compiled"]),
    ("tp_with_gdn", "UnsupportedError", ["tp_size=2", "Gated DeltaNet", "out of scope"]),
    ("uncovered_gdn", "CoverageError", ["model.layers.1.linear_attn", "not covered"]),
    ("sdpa_method_on_gdn", "CoverageError", ["runs a gdn core", "sdpa"]),
    ("all_gather_triton", "PlanError", ["State-AllGather", "eager"]),
    ("all_gather_head_tail_triton", "PlanError", ["State-AllGather", "eager"]),
    ("bad_backend", "PlanError", ["backend", "cuda"]),
    ("bad_chunk", "PlanError", ["chunk_size", "positive"]),
])
def test_gdn_fail_fast_rule(name, kind, words):
    assert_fails_with(name, errors()[name], kind, words)


def test_compile_never_runs_the_library_gdn_forward():
    """transformers may send Qwen3.5's GDN to kernels that cannot run here (fla-core on a CPU
    machine); compile's probe and the CP regions use cpcompile's statement of the layer."""
    assert errors()["library_forward_never_runs"] is None, errors()["library_forward_never_runs"]


def test_gdn_cp1_leaves_the_model_untouched():
    assert errors()["cp1_untouched"] is True
