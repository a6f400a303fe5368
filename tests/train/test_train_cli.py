"""`cpcompile train` and `bench`: the loop's losses equal an unrewritten copy trained on the whole
batch, the config's errors name their field, and both verbs run the example config under torchrun."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from dist_utils import run_distributed
from cp_harness import sdpa_plan
from gdn_harness import TEXT, gdn_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


QWEN3 = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def _config(cp: int, seed: int, model: str = "qwen3_5", **train) -> dict:
    models = {"qwen3_5": ({"model_type": "qwen3_5_text", **TEXT}, gdn_plan(cp, "p2p", sdpa="sdpa_hf")),
              "qwen3": ({"model_type": "qwen3", **QWEN3}, sdpa_plan(cp))}
    model_config, plan = models[model]
    return {"model": model_config,
            "train": {"steps": 3, "seq_len": 16 * cp, "batch_size": 2, "lr": 1e-2, "seed": seed, "verify": True,
                      **train},
            **plan}


def _train(rank: int, world: int, seed: int, model: str) -> list[dict]:
    from cpcompile.trainer import load_train_config, train

    tolerance = {"verify_rtol": 1e-3} if model == "qwen3_5" else {}  # as the test below holds it
    return train(load_train_config(_config(world, seed, model, **tolerance)), log=lambda _: None)


@pytest.mark.parametrize("model", ["qwen3", "qwen3_5"])
def test_losses_follow_the_unrewritten_model(model):
    """Three AdamW steps (lr 1e-2, so the parameters move): each step's CP=2 loss equals the loss of
    a copy without CP trained on the whole batch. Qwen3.5's first loss is held as tightly; its later
    ones within 1e-3, since its reference (transformers' own GDN path, fp32 inside) and CP differ on
    the decay parameters' ill-conditioned gradients, whose sign Adam's first steps follow."""
    records = run_distributed(_train, 2, random.randrange(1 << 30), model, timeout=300)
    later = 1e-5 if model == "qwen3" else 1e-3
    for per_rank in records:
        assert [r["step"] for r in per_rank] == [1, 2, 3]
        for r in per_rank:
            tol = 1e-5 if r["step"] == 1 else later
            assert abs(r["loss"] - r["reference_loss"]) <= tol * abs(r["reference_loss"]), per_rank
    assert records[0][-1]["loss"] == records[1][-1]["loss"]  # the global mean, the same on every rank


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["train"].update(epochs=2), "train.epochs"),
    (lambda c: c.update(plan_overrides=[]), "plan_overrides"),
    (lambda c: c.update(plan_overrides=None), "plan_overrides"),  # a blank `plan_overrides:` line
    (lambda c: c.pop("model"), "model"),
    (lambda c: c["model"].pop("model_type"), "model"),
    (lambda c: c["train"].update(dtype="float16"), "train.dtype"),
    (lambda c: c["train"].update(steps=0), "train.steps"),
    (lambda c: c["train"].update(lr="1e-3"), "train.lr"),
    (lambda c: c["accelerator"].update(tp_size=2), "accelerator.tp_size"),
    (lambda c: c["accelerator"].update(dp_shard_size=2), "train.verify"),  # verify trains one replica's batch
    (lambda c: c["train"].update(verify=False, batch_size=3) or c["accelerator"].update(dp_shard_size=2),
     "train.batch_size"),
    (lambda c: c["train"].update(activation_checkpointing="sometimes"), "train.activation_checkpointing"),
    (lambda c: c["train"].update(mixed_precision={"param_dtype": "float8"}), "train.mixed_precision.param_dtype"),
    (lambda c: c["train"].update(grad_clip=-1.0), "train.grad_clip"),
    (lambda c: c.update(optimizer={"warmup_steps": -1}), "optimizer.warmup_steps"),
    (lambda c: c.update(optimizer={"schedule": "linear"}), "optimizer.schedule"),
    (lambda c: c.update(optimizer={"betas": [0.9]}), "optimizer.betas"),
    (lambda c: c.update(data={"source": "text"}), "data.path"),
    (lambda c: c.update(data={"source": "jsonl", "path": "/no/such/file"}), "data.path"),
    (lambda c: c.update(data={"packing": "yes"}), "data.packing"),
    (lambda c: c.update(checkpoint={"interval": 2}), "checkpoint.interval"),
    (lambda c: c.update(model={"path": "/no/such/folder"}), "model.path"),
    (lambda c: c.update(trainer={}), "trainer"),
    (lambda c: c["model"].update(hidden_sise=64), "model.hidden_sise"),
    (lambda c: c["model"].update(model_type="no_such_model"), "model.model_type"),
    (lambda c: c["train"].update(seq_len=33), "train.seq_len"),
    (lambda c: c["train"].update(verify_rtol=0), "train.verify_rtol"),
    (lambda c: c["train"].update(verify="yes"), "train.verify"),
    (lambda c: c["train"].update(dump_dir=["x"]), "train.dump_dir"),
    (lambda c: c["train"].update(compile_backend="inductr"), "train.compile_backend"),
    (lambda c: c["train"].update(collective_timeout_s=0), "train.collective_timeout_s"),
])
def test_config_errors_name_the_field(edit, field):
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config

    config = _config(2, 0)
    edit(config)
    with pytest.raises(PlanError) as info:
        load_train_config(config)
    assert info.value.field == field, info.value


@pytest.mark.parametrize("content", [b"\x1f\x8b\x08\x00\xff\xfe binary", b"tokens\x00\x00\x01\x02"],
                         ids=["not-utf8", "nul-bytes"])
@pytest.mark.parametrize("source", ["text", "jsonl"])
def test_a_binary_data_file_names_the_field(tmp_path, content, source):
    """A binary file (an archive, tokenized ids) used to be a UnicodeDecodeError at the first batch."""
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config

    (tmp_path / "data.bin").write_bytes(content)
    config = _config(2, 0)
    config["data"] = {"source": source, "path": str(tmp_path / "data.bin")}
    with pytest.raises(PlanError) as info:
        load_train_config(config)
    assert info.value.field == "data.path" and "data.bin" in info.value.reason, info.value


def test_a_misspelt_section_is_told_the_trainer_sections():
    """`optimiser:` used to be told the plan's two keys (accelerator, plan_overrides)."""
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config

    config = _config(2, 0)
    config["optimiser"] = {"warmup_steps": 2}
    with pytest.raises(PlanError) as info:
        load_train_config(config)
    assert info.value.field == "optimiser", info.value
    for word in ("model", "train", "optimizer", "data", "checkpoint", "accelerator", "plan_overrides",
                 "did you mean 'optimizer'"):
        assert word in info.value.reason, info.value


def test_model_keys_transformers_converts_are_kept():
    """A key transformers still reads under an older name (rope_theta, into rope_parameters) is
    not a stray key; a misspelt one names its likely spelling."""
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config, model_config

    config = _config(2, 0, "qwen3")
    config["model"]["rope_theta"] = 5000.0
    assert model_config(load_train_config(config).model).rope_parameters["rope_theta"] == 5000.0
    config["model"]["hidden_sise"] = 64
    with pytest.raises(PlanError, match="did you mean 'hidden_size'"):
        load_train_config(config)


def test_an_unwritable_dump_dir_names_the_field(tmp_path):
    from cpcompile.errors import PlanError
    from cpcompile.trainer.loop import rank_dump_dir

    (tmp_path / "file").write_text("")
    with pytest.raises(PlanError) as info:
        rank_dump_dir(str(tmp_path / "file"), 1, 2)
    assert info.value.field == "train.dump_dir" and "rank1" in info.value.reason, info.value
    assert rank_dump_dir(str(tmp_path / "dump"), 1, 2) == str(tmp_path / "dump" / "rank1")
    assert rank_dump_dir(str(tmp_path / "alone"), 0, 1) == str(tmp_path / "alone")  # one process: no rank folder


def _cli(verb: str, *args: str, torchrun: bool = False) -> str:
    """`verb` on the example config: as the README launches it (`python -m cpcompile VERB
    --nproc-per-node 2 CONFIG`), or under torchrun."""
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    config = os.path.join(ROOT, "examples", "train_qwen3_5_p2p.yaml")
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "cpcompile", verb, config, *args]
    else:
        cmd = [sys.executable, "-m", "cpcompile", verb, "--nproc-per-node", "2", config, *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


def test_cli_trains_the_example_as_the_readme_launches_it(tmp_path):
    """As the README says: one line per step from rank 0 and, with --metrics FILE, one JSON line per
    step in FILE."""
    metrics = tmp_path / "metrics.jsonl"
    out = _cli("train", "--steps", "2", "--metrics", str(metrics))
    assert "step 2/2" in out and "CP=1 loss" in out and "verify: PASS" in out, out
    assert sum(line.startswith("step ") for line in out.splitlines()) == 2, out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all("loss" in r for r in records), records


def test_cli_benches_the_example_under_torchrun():
    out = _cli("bench", "--warmup", "0", "--repeat", "1", "--full-sequence", torchrun=True)
    rows = [line for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [r.split("|")[2].strip() for r in rows] == ["64", "64", "128"], out
    assert rows[0].startswith("| CP=2: gdn:p2p") and "sdpa:all_gather" in rows[0], out


def test_cli_reports_a_bad_config_without_a_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {model_type: qwen3_5_text}\ntrain: {steps: -1}\naccelerator: {cp_size: 2}\n")
    res = subprocess.run([sys.executable, "-m", "cpcompile", "train", str(path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    assert res.stderr == "cpcompile train: error: train.steps: must be an integer >= 1, got -1\n", res.stderr


@pytest.mark.parametrize("record, dtype, fails", [
    ({"loss": 2.0001, "reference_loss": 2.0}, "float32", False),  # 5e-5 relative: within 1e-4
    ({"loss": 2.001, "reference_loss": 2.0}, "float32", True),  # 5e-4
    ({"loss": float("nan"), "reference_loss": 2.0}, "float32", True),
    ({"loss": 2.002, "reference_loss": 2.003, "fp32_reference_loss": 2.0}, "bfloat16", False),  # 1e-3 vs 1.5e-3
    ({"loss": 2.01, "reference_loss": 2.001, "fp32_reference_loss": 2.0}, "bfloat16", True),  # 5e-3 vs 5e-4
])
def test_verify_judges_each_step(record, dtype, fails):
    """fp32: within train.verify_rtol of the unrewritten copy; bf16: against the fp32 copy, within
    1.5x the bf16 copy's error + 1e-3 (cpcompile/parity.py)."""
    from cpcompile.trainer import TrainSettings
    from cpcompile.trainer.verify import step_failure

    failure = step_failure({"step": 3, **record}, TrainSettings(dtype=dtype, verify=True), cp_size=2)
    assert (failure is not None) == fails, failure
    if fails:
        assert failure.startswith("train.verify: step 3: ") and "\n" not in failure


def test_bench_refuses_tensor_parallelism_before_any_process_group():
    """`cpcompile bench` compares CP with one device's share and has no TP rows: tp_size > 1 is a
    PlanError naming the field, raised before the world size is checked."""
    from cpcompile.bench import bench
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config

    config = _config(2, 0, model="qwen3", verify=False)
    config["accelerator"]["tp_size"] = 2
    with pytest.raises(PlanError, match="accelerator.tp_size.*cpcompile bench times CP alone"):
        bench(load_train_config(config), warmup=0, repeat=1)
