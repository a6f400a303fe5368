"""What the trainer reports: only global rank 0 logs (step lines with loss, grad-norm, lr,
tokens/s, step time; a summary; JSONL); `--dry-run` prints mesh, coverage, a memory estimate and
the CP ranks' expected imbalance;
FSDP2 mixed precision runs with activation checkpointing;
a non-finite loss or gradient norm stops the run naming the step; a text/JSONL file is read
with the byte-level tokenizer, one document per row."""
from __future__ import annotations

import json
import random

import pytest

from cp_harness import sdpa_plan
from dist_utils import run_distributed

QWEN3 = dict(model_type="qwen3", vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _config(seed: int, **sections) -> dict:
    config = {"model": QWEN3, **sdpa_plan(2),
              "train": {"steps": 2, "seq_len": 16, "batch_size": 2, "lr": 1e-2, "seed": seed}}
    config.update(sections)
    return config


def _logs_of_each_rank(rank: int, world: int, seed: int, folder: str) -> dict:
    from cpcompile.trainer import dry_run, load_train_config, train

    lines = []
    data = {"source": "jsonl", "path": f"{folder}/docs.jsonl"}
    metrics = f"{folder}/metrics.jsonl"
    config = _config(seed, data=data)
    config["train"]["metrics_file"] = metrics
    records = train(load_train_config(config), log=lines.append)
    dry = []
    facts = dry_run(load_train_config(_config(seed)), log=dry.append)
    mixed = _config(seed, data=data)
    mixed["train"].update(mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                          activation_checkpointing="every_layer")
    bf16 = train(load_train_config(mixed), log=lambda _: None)
    return {"lines": lines, "records": records, "dry": dry, "regions": facts["regions"], "bf16": bf16}


def test_rank_0_logs_steps_a_summary_and_jsonl_and_dry_run_reports(tmp_path):
    docs = ["héllo wörld " * 3, "a short one", "x" * 40]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    results = run_distributed(_logs_of_each_rank, 2, random.randrange(1 << 30), str(tmp_path), timeout=300)
    rank0, rank1 = results
    assert rank1["lines"] == [] and rank1["dry"] == []
    steps = [line for line in rank0["lines"] if line.startswith("step ")]
    assert len(steps) == 2 and all(k in steps[0] for k in ("loss", "grad-norm", "lr", "tok/s", " s")), steps
    assert rank0["lines"][-1].startswith("summary: 2 steps"), rank0["lines"]
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in written] == [r["loss"] for r in rank0["records"]]
    assert rank0["dry"][0].startswith("mesh: ") and "plan coverage: 2 region(s)" in rank0["dry"][1], rank0["dry"]
    assert "memory estimate" in rank0["dry"][-2], rank0["dry"]
    assert "rank balance" in rank0["dry"][-1] and "busiest CP rank 1 / least busy rank 0" in rank0["dry"][-1]
    assert [name for name, _ in rank0["regions"]] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    # FSDP2 mixed precision (bf16 compute, fp32 reduce) with activation checkpointing: the same
    # losses as float32 to bf16 accuracy (worst relative gap 1.8e-3 in 30 fresh seeds)
    for got, want in zip(rank0["bf16"], rank0["records"]):
        assert abs(got["loss"] - want["loss"]) <= 2e-2 * want["loss"], (rank0["bf16"], rank0["records"])


def _dry_run_at(rank: int, world: int, seq_len: int) -> tuple[list[str], dict]:
    from cpcompile.trainer import dry_run, load_train_config

    config = _config(0)
    config["train"]["seq_len"] = seq_len
    lines = []
    facts = dry_run(load_train_config(config), log=lines.append)
    return lines, facts


def test_a_dry_run_at_a_huge_length_traces_a_short_probe_and_says_so():
    """seq_len 1048576 (issue 31): the dry run used to run its probe forward on the whole
    sequence, silently, for minutes; it traces a 32-token probe batch and says it, while the
    memory estimate is still for the whole length."""
    lines, facts = run_distributed(_dry_run_at, 2, 1 << 20, timeout=120)[0]
    assert facts["probe_seq_len"] == 32, facts
    assert "probe batch of 32 of train.seq_len's 1048576 tokens" in lines[1], lines
    # 512K tokens x what 2 layers a rank keep without checkpointing (memory_layers.layer_saved_bytes)
    # layers a rank (the chunked loss's logits are one chunk's, whatever the length)
    assert facts["memory_gib"]["activations"] > 1.0, facts


def _dry_run_within(rank: int, world: int, memory_gib: float) -> tuple[list[str], dict]:
    from cpcompile.trainer import dry_run, load_train_config

    lines = []
    facts = dry_run(load_train_config(_config(0)), log=lines.append, memory_gib=memory_gib)
    return lines, facts


def test_a_dry_run_with_a_memory_budget_names_the_longest_length_that_fits():
    """cp 2 (a plan whose layout wants seq_len a multiple of the CP size): the longest length is a
    multiple of it, the estimate at it fits the budget and one multiple more does not."""
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.dry_run_report import seq_len_multiple
    from cpcompile.trainer.memory import total_at_length

    lines, facts = run_distributed(_dry_run_within, 2, 0.05, timeout=120)[0]
    longest = facts["longest_seq_len"]
    config = load_train_config(_config(0))
    multiple = seq_len_multiple(config.plan)
    assert multiple > 1 and longest > 0 and longest % multiple == 0, (multiple, facts)
    assert f"within 0.05 GiB a rank, by the estimate: {longest} tokens" in lines[-1], lines

    def total(seq_len: int) -> float:
        return total_at_length(config, facts["parameters"], facts["model_config"], seq_len)
    assert total(longest) <= 0.05 < total(longest + multiple)


def test_a_dry_run_budget_below_what_the_length_does_not_change_says_none_fits():
    lines, facts = run_distributed(_dry_run_within, 2, 1e-6, timeout=120)[0]
    assert facts["longest_seq_len"] == 0 and "none" in lines[-1], lines


def test_a_memory_budget_must_be_positive():
    from cpcompile.errors import PlanError
    from cpcompile.trainer.dry_run_report import memory_budget_gib

    for bad in (0, -1.0, True, "100"):
        with pytest.raises(PlanError, match="--memory-gib"):
            memory_budget_gib("cpu", bad)


def test_the_cli_takes_a_memory_budget_only_with_the_dry_run(tmp_path, capsys):
    from cpcompile.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["train", str(tmp_path / "any.yaml"), "--memory-gib", "80"])
    assert stop.value.code == 2 and "--memory-gib goes with --dry-run" in capsys.readouterr().err


def test_byte_tokenizer_rows_hold_one_document_each(tmp_path):
    from cpcompile.trainer.config import DataSettings, TrainSettings
    from cpcompile.trainer.data import TokenStream

    (tmp_path / "docs.txt").write_text("ab\n\ncdef")
    data = DataSettings(source="text", path=str(tmp_path / "docs.txt"))
    stream = TokenStream(data, TrainSettings(seq_len=4, batch_size=2), vocab_size=257)
    batch = stream.batch(0)
    assert batch["input_ids"].tolist() == [[97, 98, 256, 256], [99, 100, 101, 102]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[97, 98, 256, -100], [99, 100, 101, 102]]
    # replicas read disjoint rows of the same global batch
    assert stream.batch(1, 1, 2)["input_ids"].tolist() == [[99, 100, 101, 102]]


def test_a_vocabulary_smaller_than_the_byte_tokenizer_names_the_field(tmp_path):
    from cpcompile.errors import PlanError
    from cpcompile.trainer.config import DataSettings, TrainSettings
    from cpcompile.trainer.data import TokenStream

    (tmp_path / "docs.txt").write_text("ab")
    data = DataSettings(source="text", path=str(tmp_path / "docs.txt"))
    with pytest.raises(PlanError) as info:
        TokenStream(data, TrainSettings(), vocab_size=100)
    assert info.value.field == "model.vocab_size"


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_a_non_finite_step_stops_the_run_naming_the_step(key):
    from cpcompile.trainer.metrics import NonFiniteError, check_finite

    record = {"step": 7, "loss": 2.0, "grad_norm": 1.0, key: float("nan")}
    with pytest.raises(NonFiniteError, match=f"step 7: the {key.replace('_', ' ')} is nan"):
        check_finite(record)
