"""Issue 52 items 2-3: a stock Hugging Face `Trainer` at cp 2 and cp 4 (`context_parallel`, gloo)
equals the same Trainer in one process, step by step: loss within 1e-5 relative over 5 steps,
gradient norm, eval loss, token count, and a checkpoint `from_pretrained` reads back; tiny Llama
and tiny Qwen3.5, padded and packed (DataCollatorWithFlattening) batches, gradient accumulation,
gradients reduced by DDP or by FSDP2 over dp x cp (`fsdp=True`, at cp 2 and at dp 2 x cp 2). One
launch per world size and reduction runs every case (dp 2 x cp 2: DDP and FSDP2 in one launch)."""
from __future__ import annotations

import random

import pytest

from dist_utils import run_distributed
from hf_trainer_cases import fresh_out_dir, run_case

pytest.importorskip("accelerate")

# (model, packed, gradient accumulation steps[, average_tokens_across_devices]); every case has its
# one-process reference, each runs at cp 2 with DDP or with FSDP2, some at cp 4 too (CI time)
CASES = [("llama", False, 1), ("llama", True, 2), ("qwen3_5", False, 2), ("qwen3_5", True, 1)]
CASES_FSDP2 = [("qwen3_5", False, 2)]  # context_parallel(fsdp=True): padded, gradient accumulation
CASES_DDP = [case for case in CASES if case not in CASES_FSDP2]
CASES_AT_4 = [("llama", True, 2), ("qwen3_5", False, 2)]  # one of each model at cp 4: packed, padded


def _reset_accelerate() -> None:
    # a forked rank must not inherit a parent's accelerate state (it would think it is alone)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _run_all(rank: int, world: int, seed: int, cp: int | None, cases=tuple(CASES), fsdp: bool = False,
             fsdp_cases=()) -> dict:
    """`cases` with DDP (or all with FSDP2: `fsdp`); `fsdp_cases` also with FSDP2, keyed `_fsdp2(case)`."""
    _reset_accelerate()
    runs = {case: run_case(*case[:2], seed, cp, fresh_out_dir(), *case[2:], fsdp=fsdp) for case in cases}
    for case in fsdp_cases:
        runs[_fsdp2(case)] = run_case(*case[:2], seed, cp, fresh_out_dir(), *case[2:], fsdp=True)
    return runs


def _fsdp2(case: tuple) -> tuple:
    return (*case, "fsdp2")


def _close(got: float, want: float, tol: float) -> bool:
    return abs(got - want) <= tol * abs(want)


def test_trainer_at_cp_2_and_4_equals_one_process():
    """cp 2 with DDP (the Trainer's) and with FSDP2 (`fsdp=True`: also the full checkpoint) in one
    launch, cp 4 with DDP."""
    seed = random.randrange(1 << 20)
    reference = run_distributed(_run_all, 1, seed, None, timeout=300, init_pg=False)[0]
    got = run_distributed(_run_all, 2, seed, 2, tuple(CASES_DDP), False, tuple(CASES_FSDP2), timeout=300)
    _assert_same_run(got, {**{case: reference[case] for case in CASES_DDP},
                           **{_fsdp2(case): reference[case] for case in CASES_FSDP2}}, 2, seed)
    got = run_distributed(_run_all, 4, seed, 4, tuple(CASES_AT_4), False, timeout=300)
    _assert_same_run(got, {case: reference[case] for case in CASES_AT_4}, 4, seed)


def test_trainer_at_dp_2_cp_2_equals_dp_2():
    """4 processes, a plan naming cp 2 only: dp = 2 from the launch; the stock Trainer on 2 processes
    (DDP over dp alone) is the reference, its batches split over the same 2 dp ranks. Also with
    average_tokens_across_devices off (each dp rank's own mean, averaged), and in the same launch with
    FSDP2 sharding over dp x cp (`fsdp=True`: dp_shard_size 2 from the launch; the full checkpoint too)."""
    seed, cases = random.randrange(1 << 20), (("llama", True, 2), ("llama", False, 1, False))
    fsdp_cases = cases[:1]  # packed, gradient accumulation: FSDP2's reduce-scatter deferred over dp x cp
    reference = run_distributed(_run_all, 2, seed, None, cases, timeout=300)[0]
    got = run_distributed(_run_all, 4, seed, 2, cases, False, fsdp_cases, timeout=300)
    _assert_same_run(got, {**reference, **{_fsdp2(case): reference[case] for case in fsdp_cases}}, 2, seed)


def _assert_same_run(results: list[dict], reference: dict, cp: int, seed: int, fsdp: bool = False) -> None:
    """`fsdp`: every case ran with FSDP2; otherwise only those keyed `_fsdp2(case)`."""
    for case, want in reference.items():
        for rank, got in enumerate(results):
            where = f"{case} at cp={cp} (rank {rank}, seed {seed})"
            assert len(got[case]["loss"]) == len(want["loss"]) == 5, where
            for step, (g, w) in enumerate(zip(got[case]["loss"], want["loss"])):
                assert _close(g, w, 1e-5), f"{where}: step {step} loss {g} vs {w}"
            for step, (g, w) in enumerate(zip(got[case]["grad_norm"], want["grad_norm"])):
                assert _close(g, w, 1e-4), f"{where}: step {step} grad norm {g} vs {w}"
            assert _close(got[case]["eval_loss"], want["eval_loss"], 1e-5), where
            assert got[case]["tokens"] == want["tokens"], where
            assert want["head_calls"] > 0 and got[case]["head_calls"] == 0, f"{where}: the loss ran the head whole"
            # FSDP2 shards over every rank of the job (dp x cp); DDP keeps whole parameters
            sharded = fsdp or case[-1] == "fsdp2"
            assert got[case]["shards"] == (len(results) if sharded else 1), where
        assert results[0][case]["saved"] == 0.0, f"{case} at cp={cp}: saved checkpoint differs"
