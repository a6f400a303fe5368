"""The trainer with tensor parallelism: PyTorch TP first, then the CP rewrite, then FSDP2 over
dp_shard x cp (2-D with the tp mesh), 8 gloo ranks as dp_shard 2 x tp 2 x cp 2, float64, against
one process without CP, TP or FSDP; and the refusals, one test each: a Gated DeltaNet model,
heads tp does not split, HSDP, TP without CP, a layer without the linears TP splits."""
from __future__ import annotations

import random

import pytest

from cp_harness import assert_fails_with, outcome_of, sdpa_plan
from dist_utils import run_distributed
from gdn_harness import TEXT, gdn_plan

# 4 query and 2 KV heads: tp 2 splits whole heads (2 and 1 per rank)
QWEN3 = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
STEPS = 3


def qwen3_config(seed: int, **sizes) -> dict:
    plan = sdpa_plan(sizes.get("cp_size", 1))
    plan["accelerator"].update(sizes)
    # grad_clip well under the gradient norm: every step clips, so the trajectory depends on the
    # global norm over DTensors of two meshes (TP linears on (dp_shard_cp, tp), the rest on dp_shard_cp)
    return {"model": {"model_type": "qwen3", **QWEN3},
            "train": {"steps": STEPS, "seq_len": 16, "batch_size": 2, "lr": 1e-2, "seed": seed, "dtype": "float64",
                      "grad_clip": 0.05},
            "optimizer": {"warmup_steps": 1}, **plan}


def _curves(rank: int, world: int, config: dict) -> list[tuple]:
    from cpcompile.trainer import load_train_config, train

    records = train(load_train_config(config), log=lambda _: None)
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records]


@pytest.mark.slow  # 8 forked ranks: ~25-45 s on the 2-core CI box
def test_fsdp_tp_cp_follows_one_process():
    """dp_shard 2 x tp 2 x cp 2 (SDPA AllGather, every layer checkpointed) against one process
    without a plan: every step's loss, gradient norm (before clipping) and learning rate within
    1e-6, the same on every rank."""
    seed = random.randrange(1 << 30)
    config = qwen3_config(seed, dp_shard_size=2, tp_size=2, cp_size=2)
    config["train"]["activation_checkpointing"] = "every_layer"
    distributed = run_distributed(_curves, 8, config, timeout=600)
    single = run_distributed(_curves, 1, qwen3_config(seed), timeout=300)[0]
    assert single[0][2] > 0.05  # the clip bites
    for curves in distributed:
        assert len(curves) == STEPS and curves == distributed[0]
    for got, want in zip(distributed[0], single):
        assert got[0] == want[0] and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got[1:], want[1:])), (got, want)


def _gdn_config() -> dict:
    config = {"model": {"model_type": "qwen3_5_text", **TEXT}, "train": {"seq_len": 32, "batch_size": 2},
              **gdn_plan(2, "p2p", sdpa="sdpa_hf")}
    config["accelerator"]["tp_size"] = 2
    return config


@pytest.mark.parametrize("edit, field, words", [
    (lambda c: c, "accelerator.tp_size", ["Gated DeltaNet", "qwen3_5_text", "out of scope", "recurrent state"]),
    # GDN layers but only SDPA regions in the plan: still refused (the model has GDN layers)
    (lambda c: c.update(sdpa_plan(2)) or c["accelerator"].update(tp_size=2), "accelerator.tp_size",
     ["Gated DeltaNet"]),
])
def test_tp_with_a_gdn_model_is_refused(edit, field, words):
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config

    config = _gdn_config()
    edit(config)
    with pytest.raises(PlanError) as info:
        load_train_config(config)
    assert info.value.field == field and all(w in str(info.value) for w in words), info.value


@pytest.mark.parametrize("sizes, field, words", [
    ({"tp_size": 3, "cp_size": 2}, "accelerator.tp_size", ["num_attention_heads=4", "whole heads"]),
    ({"tp_size": 2, "cp_size": 2, "dp_replicate_size": 2}, "accelerator.dp_replicate_size", ["HSDP + TP"]),
    ({"tp_size": 2}, "accelerator.tp_size", ["cp_size=1", "q_norm", "full gradient"]),
])
def test_tp_sizes_the_trainer_cannot_run_are_refused(sizes, field, words):
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config

    with pytest.raises(PlanError) as info:
        load_train_config(qwen3_config(0, **sizes))
    assert info.value.field == field and all(w in str(info.value) for w in words), info.value


def _no_gate_proj(rank: int, world: int):
    """Under the fake process group (4 ranks as tp 2 x cp 2): a layer whose MLP lacks a linear."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cpcompile import build_mesh
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.parallelize import apply_tensor_parallel, build_model

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    config = load_train_config(qwen3_config(0, tp_size=2, cp_size=2))
    model = build_model(config.model, config.train)
    model.model.layers[1].mlp.gate_proj = torch.nn.Identity()
    outcome = outcome_of(lambda: apply_tensor_parallel(model, build_mesh(config.plan.accelerator, "cpu")))
    dist.destroy_process_group()
    return outcome


def test_a_layer_without_the_linears_tp_splits_is_refused():
    outcome = run_distributed(_no_gate_proj, 1, init_pg=False, timeout=300)[0]
    assert_fails_with("no_gate_proj", outcome, "PlanError",
                      ["accelerator.tp_size", "model.layers.1", "mlp", "gate_proj"])
