"""The trainer (cpcompile/trainer/) in real gloo runs, float64: FSDP2 over dp_shard x cp keeps the
trajectory of one process without CP; activation checkpointing changes nothing, with every SDPA
method and GDN State-P2P; a run stopped and resumed from its DCP checkpoint continues the same
trajectory (also with another data-parallel layout); another CP size is refused.

Several trainers are built inside one forked job per world size (processes are the cost here);
activation checkpointing with the SDPA methods is checked on the compiled model directly."""
from __future__ import annotations

import copy
import random
import shutil

import pytest

from cp_harness import sdpa_plan
from dist_utils import run_distributed
from gdn_harness import TEXT, TWO_LAYERS, gdn_plan

STEPS = 4
# lr 1e-3, not 1e-2: at 1e-2 these 4 random-token steps are chaotic enough that the float64 runs'
# difference (~1e-10 in step 1's gradient norm, see STEP_1_RTOL) grew past 1e-6 by step 3 in 1 CI
# run, and to 7.7e-7 in 1 of 40 seeds here; eps 1e-6 did not tame it. At 1e-3, 60 seeds: worst
# 1.3e-8 over the 4 steps (scratch sweep of dp_shard 2 x cp 2 vs one process).
LR = 1e-3
# Step 1 (one forward and backward from the same weights) is exact but for the fp32 casts Qwen3.5's
# GDN layer keeps in float64 runs: its gradient norm differed by 5e-11 (median) to 3.2e-10 (worst)
# in 251 runs of the sweep above; a CP bug moves it by far more than 1e-8.
STEP_1_RTOL = 1e-8


# The runs of this file: one GDN layer and one full-attention layer (TWO_LAYERS: both kinds of
# region, each rewritten: GDN State-P2P, SDPA AllGather). Tracing a region is most of a trainer's
# build on the CI box and a 4-rank job here builds five at cp 2, so two regions rather than TEXT's
# four (3 GDN + 1 attention; the default, what other files import `qwen3_5_config` for).


def qwen3_5_config(seed: int, cp: int = 2, dp_shard: int = 1, dp_replicate: int = 1, model: dict | None = None,
                   **train) -> dict:
    plan = gdn_plan(cp, "p2p", sdpa="sdpa_hf")
    plan["accelerator"].update(dp_shard_size=dp_shard, dp_replicate_size=dp_replicate)
    return {"model": {"model_type": "qwen3_5_text", **TEXT, **(model or {})},
            "train": {"steps": STEPS, "seq_len": 32, "batch_size": 4, "lr": LR, "seed": seed, "dtype": "float64",
                      "gdn_backend": "eager", **train},
            "optimizer": {"warmup_steps": 1}, **plan}


def without_cp(config: dict) -> dict:
    """The same run in one process: no mesh sizes, no plan."""
    config = copy.deepcopy(config)
    config.pop("plan_overrides")
    config["accelerator"] = {}
    return config


def _run(config: dict, **kwargs) -> list[dict]:
    from cpcompile.trainer import load_train_config, train

    return train(load_train_config(config), log=lambda _: None, **kwargs)


def refusal(config: dict) -> str:
    """The message a run of `config` stops with before anything is built (config, then start-up checks)."""
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.startup import check_before_building

    with pytest.raises(PlanError) as caught:
        check_before_building(load_train_config(config))
    return str(caught.value)


def _curves(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records]


def _run_with_parameters(config: dict) -> tuple[list[tuple], list[float]]:
    """Run `config`; -> its curves and every parameter after the last optimizer step, gathered whole."""
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.loop import build_trainer

    trainer = build_trainer(load_train_config(config))
    records = [trainer.step(index) for index in range(STEPS)]
    return _curves(records), [p.full_tensor().sum().item() for p in trainer.model.parameters()]


def _four_ranks(rank: int, world: int, seed: int, folders: tuple[str, str]) -> dict:
    import torch.distributed as dist

    base = qwen3_5_config(seed, cp=2, dp_shard=2, model=TWO_LAYERS)
    out = {}
    out["fsdp_cp"], out["parameters"] = _run_with_parameters(base)
    out["with_ac"] = _curves(_run(qwen3_5_config(seed, cp=2, dp_shard=2, model=TWO_LAYERS,
                                                 activation_checkpointing="every_layer")))
    saving = dict(base, checkpoint={"folder": folders[0], "interval": 2})
    out["stopped"] = _curves(_run(saving, stop_after=2))
    out["resumed"] = _curves(_run(saving))
    if rank == 0:  # keep step 2 only: the next resume starts there
        shutil.rmtree(f"{folders[0]}/step-{STEPS}")
    dist.barrier()
    # the same checkpoint resumed with the data-parallel ranks replicating instead of sharding
    out["resumed_other_dp"] = _curves(_run(dict(qwen3_5_config(seed, cp=2, dp_replicate=2, model=TWO_LAYERS),
                                                checkpoint={"folder": folders[0]})))
    # dp_shard 4 without CP, stopped at step 2: the one-rank job resumes it
    dp4 = dict(qwen3_5_config(seed, cp=1, dp_shard=4, model=TWO_LAYERS), checkpoint={"folder": folders[1]})
    out["dp4_stopped"] = _curves(_run(dp4, stop_after=2))
    return out


def _one_rank(rank: int, world: int, seed: int, folders: tuple[str, str]) -> dict:
    from cpcompile.errors import CPConfigError

    base = without_cp(qwen3_5_config(seed, model=TWO_LAYERS))
    cp1 = qwen3_5_config(seed, model=TWO_LAYERS)
    cp1["accelerator"]["cp_size"] = 1
    out = {"no_cp": _curves(_run(base)), "cp1_with_plan": _curves(_run(cp1)),
           "dp1_resumed": _curves(_run(dict(base, checkpoint={"folder": folders[1]})))}
    try:
        _run(dict(base, checkpoint={"folder": folders[0]}))
    except CPConfigError as exc:
        out["other_cp"] = str(exc)
    return out


def _close(a: list[tuple], b: list[tuple], rtol: float) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and all(abs(p - q) <= rtol * abs(q) for p, q in zip(x[1:], y[1:]))
                                    for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    seed = random.randrange(1 << 30)
    folders = (str(tmp_path_factory.mktemp("ckpt_cp2")), str(tmp_path_factory.mktemp("ckpt_dp4")))
    four = run_distributed(_four_ranks, 4, seed, folders, timeout=600)
    one = run_distributed(_one_rank, 1, seed, folders, timeout=300)[0]
    return four, one


def test_fsdp_over_dp_shard_x_cp_follows_one_process_without_cp(runs):
    """dp_shard 2 x cp 2 (GDN State-P2P + SDPA AllGather) against one process without a plan:
    the first step's loss, gradient norm and learning rate within `STEP_1_RTOL` in float64, the whole
    trajectory within 1e-6 (the issue's bound for its parity case: float64 rounding, ~1e-10 in
    step 1's gradient norm where the GDN decay gradients sum cancelling terms, grows over the
    AdamW steps; at `LR` the worst of 60 seeds was 1.3e-8); the loss is the global mean, the same
    on every rank."""
    four, one = runs
    assert _close(four[0]["fsdp_cp"][:1], one["no_cp"][:1], STEP_1_RTOL), (four[0]["fsdp_cp"], one["no_cp"])
    assert _close(four[0]["fsdp_cp"], one["no_cp"], 1e-6), (four[0]["fsdp_cp"], one["no_cp"])
    assert all(r["fsdp_cp"] == four[0]["fsdp_cp"] for r in four)


def test_cp_1_is_the_run_without_a_plan(runs):
    _, one = runs
    assert one["cp1_with_plan"] == one["no_cp"]


def test_parameters_stay_identical_across_ranks(runs):
    """After optimizer steps every rank holds the same whole parameters (RFC item 11)."""
    four, _ = runs
    assert all(r["parameters"] == four[0]["parameters"] for r in four)


def test_activation_checkpointing_changes_nothing_with_gdn_p2p(runs):
    four, _ = runs
    assert _close(four[0]["with_ac"], four[0]["fsdp_cp"], 1e-12), (four[0]["with_ac"], four[0]["fsdp_cp"])


def test_a_resumed_run_continues_the_same_trajectory(runs):
    """Stopped after step 2, resumed from its DCP checkpoint: steps 3-4 identical to the
    uninterrupted run. DCP reshards, so the same checkpoint resumes with dp_replicate 2 instead of
    dp_shard 2 (within 1e-12: worst 3e-16 in 22 fresh seeds), and one of dp_shard 4 (cp 1) in one
    process: the same trajectory within rounding (1e-6: float64 sums in another order, amplified by
    the GDN decay gradients and AdamW as above)."""
    four, one = runs
    full = four[0]["fsdp_cp"]
    assert four[0]["stopped"] == full[:2]
    assert four[0]["resumed"] == full[2:]
    assert _close(four[0]["resumed_other_dp"], full[2:], 1e-12), (four[0]["resumed_other_dp"], full[2:])
    assert _close(four[0]["dp4_stopped"], one["no_cp"][:2], 1e-6), (four[0]["dp4_stopped"], one["no_cp"])
    assert _close(one["dp1_resumed"], one["no_cp"][2:], 1e-6), (one["dp1_resumed"], one["no_cp"])


def test_another_cp_size_is_refused_at_resume(runs):
    """A cp 2 checkpoint resumed by a cp 1 run: refused before anything is built, naming both sizes."""
    _, one = runs
    message = one.get("other_cp", "")
    assert "cp_size=2" in message and "cp_size=1" in message and "not supported" in message, message


SDPA_METHODS = {
    "all_gather": "sdpa_hf",
    "ulysses": "sdpa_hf_ulysses",
    "hybrid": {"_target_": "cpcompile.wrappers.sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": 2},
    "head_tail": {"_target_": "cpcompile.wrappers.sdpa_hf_load_balance_cp_wrapper"},
}


def _gradients_with_and_without_ac(rank: int, world: int, seed: int) -> dict:
    """Per method: the largest gradient difference between a forward/backward of the compiled
    CP=4 model with every decoder layer checkpointed and one without, on a batch of a length the
    regions first meet inside the checkpointed forward (so they trace it there), and how often
    each rewritten attention region ran in the checkpointed step (forward + recompute)."""
    import cpcompile
    from cp_harness import qwen3_with_heads, random_batch
    from cpcompile.trainer.parallelize import apply_activation_checkpointing

    out = {}
    for name, wrapper in SDPA_METHODS.items():
        plan = cpcompile.load_plan(sdpa_plan(world, wrapper))
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
        model = qwen3_with_heads(seed, 4, 4, layers=2).double()
        example = cpcompile.shard_batch(random_batch(seed + 1, 2, 8 * world, padded=True), mesh, plan)
        cpcompile.compile(model, mesh, plan, example_inputs=example)
        local = cpcompile.shard_batch(random_batch(seed + 2, 2, 16 * world, padded=True), mesh, plan)
        calls = []
        hooks = [layer.self_attn.register_forward_hook(lambda *_: calls.append(1)) for layer in model.model.layers]
        apply_activation_checkpointing(model)
        model(**local).loss.backward()
        for hook in hooks:
            hook.remove()
        checkpointed = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        for layer in model.model.layers:
            del layer.forward  # the layer's own forward again: no checkpoint
        model(**local).loss.backward()
        worst = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), checkpointed))
        out[name] = (worst, len(calls))
    return out


def test_activation_checkpointing_composes_with_every_sdpa_method():
    """CP=4 with each SDPA method, padded batch, float64: checkpointing every layer reruns each
    rewritten region in the backward (its collectives again, on every rank alike) and leaves every
    gradient as it was — also when the region traces a new input signature inside the
    checkpointed forward (as under FSDP2 mixed precision, whose bf16 inputs the probe never saw)."""
    results = run_distributed(_gradients_with_and_without_ac, 4, random.randrange(1 << 30), timeout=600)
    for per_rank in results:
        for name, (worst, calls) in per_rank.items():
            assert calls == 4, (name, calls)  # 2 layers x (forward + recompute)
            assert worst <= 1e-12, (name, worst)
