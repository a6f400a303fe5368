"""Issue 52 item 2: what the Trainer integration refuses, one test per rule, each asserting the
one-line error names its cause. The rules run one after another in one forked process (no process
group of the test session, no accelerate state left behind; one fork instead of five, for CI time),
each on its own fresh Trainer."""
from __future__ import annotations

import contextlib
import os

import pytest

from dist_utils import run_distributed
from hf_trainer_cases import fresh_out_dir, pad_collator

pytest.importorskip("accelerate")


def _trainer(**extra_args):
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from cp_harness import tiny_llama

    AcceleratorState._reset_state(reset_partial_state=True)
    args = TrainingArguments(output_dir=fresh_out_dir(), use_cpu=True, report_to=[], max_steps=1, **extra_args)
    return Trainer(model=tiny_llama(0), args=args, train_dataset=[], data_collator=pad_collator)


def _plan(cp: int) -> dict:
    from cp_harness import sdpa_plan

    return sdpa_plan(cp)


def _refusal(rank: int, world: int, rule: str) -> tuple[str, str]:
    """(exception class name, message) of what `context_parallel` (or the first step) raised."""
    from cpcompile.integrations.transformers import context_parallel

    if rule == "accelerate_cpu_alone":
        with _accelerate_cpu_launch_env():
            return _refusal(rank, world, "as launched")
    trainer, cp, plan_changes, fsdp, options = _trainer(), 2, {}, False, {}
    if rule == "deepspeed":
        trainer.args.deepspeed = "ds_zero3.json"  # set after init: DeepSpeed itself need not be installed
    elif rule == "parallelism_config":
        from accelerate.parallelism_config import ParallelismConfig

        trainer.args.parallelism_config = ParallelismConfig(cp_size=2)
    elif rule == "fsdp":
        trainer.args.fsdp = "full_shard"
    elif rule == "dp_shard_without_fsdp":
        plan_changes = {"dp_shard_size": 2}
    elif rule == "fsdp_optimizer_checkpoints":
        trainer.args.save_strategy, cp, fsdp = "steps", 1, True
    elif rule == "fsdp_on_an_older_trainer":  # one that cannot leave gradient reduction to the model
        del trainer.is_distributed_loading_by_transformers
        trainer.args.save_strategy, cp, fsdp = "no", 1, True
    elif rule == "packing_without_positions":
        trainer.args.padding_free = True  # TRL's SFTConfig field
        cp = 1
    elif rule == "chunked_loss_with_own_compute_loss":  # as TRL's SFTTrainer, which reads the logits
        trainer.__class__ = type("OwnLossTrainer", (type(trainer),), {"compute_loss": lambda self, *a, **k: None})
        cp, options = 1, {"loss": "chunked"}
    elif rule == "unknown_loss":
        cp, options = 1, {"loss": "fused"}
    elif rule == "unknown_compile_backend":
        cp, options = 1, {"compile_backend": "no_such_backend"}
    elif rule == "torch_compile_beside_compiled_layers":
        trainer.args.torch_compile = True  # set after init, as the deepspeed rule does: nothing compiles here
        cp, options = 1, {"compile_backend": "inductor"}
    elif rule == "loss_chunk_tokens":
        cp, options = 1, {"loss_chunk_tokens": 0}
    plan = _plan(cp)
    plan["accelerator"].update(plan_changes)
    try:
        trainer = context_parallel(trainer, plan=plan, fsdp=fsdp, **options)
        if rule == "packing_without_positions":  # a stock collator told to leave the positions out
            from transformers import DataCollatorWithFlattening

            trainer.data_collator = DataCollatorWithFlattening(return_position_ids=False)
            batch = trainer.data_collator([{"input_ids": list(range(1, 9))}, {"input_ids": list(range(1, 7))}])
            trainer.compute_loss(trainer.model, batch)
    except Exception as exc:  # noqa: BLE001 - the test judges it
        return type(exc).__name__, str(exc)
    return "nothing", ""


@contextlib.contextmanager
def _accelerate_cpu_launch_env():
    """The environment `accelerate launch --cpu --num_processes 2 script.py` (accelerate 1.16, no
    --mpirun_hostfile) gives the one process it starts: ACCELERATE_USE_CPU and MASTER_ADDR/PORT, no RANK."""
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    os.environ.update(ACCELERATE_USE_CPU="True", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _refusals(rank: int, world: int, rules: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    return {rule: _refusal(rank, world, rule) for rule in rules}


RULES = [
    ("deepspeed", "CPConfigError", ("DeepSpeed", "args.deepspeed")),
    ("parallelism_config", "CPConfigError", ("parallelism_config", "cp_size")),
    ("fsdp", "CPConfigError", ("accelerate's FSDP", "args.fsdp", "fsdp=True")),
    ("dp_shard_without_fsdp", "CPConfigError", ("dp_shard_size=2", "fsdp=True")),
    ("fsdp_optimizer_checkpoints", "CPConfigError", ("fsdp=True", "optimizer state", "save_only_model")),
    ("fsdp_on_an_older_trainer", "CPConfigError", ("fsdp=True", "is_distributed_loading_by_transformers")),
    ("packing_without_positions", "CPInputError", ("packing", "position_ids", "DataCollatorWithFlattening")),
    ("world_not_divisible", "CPConfigError", ("world size 1", "not divisible", "cp_size=2")),
    ("chunked_loss_with_own_compute_loss", "CPConfigError", ("loss='chunked'", "OwnLossTrainer", "compute_loss",
                                                             "loss='model'")),
    ("unknown_loss", "CPConfigError", ("loss='fused'", "chunked", "model")),
    ("unknown_compile_backend", "CPConfigError", ("compile_backend", "no_such_backend")),
    ("torch_compile_beside_compiled_layers", "CPConfigError", ("args.torch_compile", "inductor", "turn")),
    ("loss_chunk_tokens", "CPConfigError", ("loss_chunk_tokens=0", "positive")),
    ("accelerate_cpu_alone", "CPConfigError", ("accelerate launch --cpu", "alone", "--mpirun_hostfile",
                                               "--multi_gpu", "torchrun")),
]
_cache: dict[str, tuple[str, str]] = {}


def refusal(rule: str) -> tuple[str, str]:
    if not _cache:
        _cache.update(run_distributed(_refusals, 1, tuple(r for r, _, _ in RULES), init_pg=False)[0])
    return _cache[rule]


@pytest.mark.parametrize("rule, error, words", RULES)
def test_refused_with_its_cause(rule, error, words):
    name, message = refusal(rule)
    assert name == error, (rule, name, message)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (rule, message)
